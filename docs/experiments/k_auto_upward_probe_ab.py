"""k auto with and without the probes of k + 1, in one process, the engines alternating prompt by
prompt (AR, k auto as before, k auto now), from a step-cost table whose windows of 3 or more rows
are priced FACTOR times what the start-up measurement gave (1.0: as measured; 2.0: as a busy
moment can measure them). Outputs are checked equal to AR's; tok/s against AR and the share of
rounds at each k are printed (docs/decisions.md, "k auto probes k + 1"):

    python docs/experiments/k_auto_upward_probe_ab.py PROMPTS_PER_SET PASSES FACTOR
"""

import dataclasses
import sys
import time
import types

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
from specfork.speculative.auto_k import FIRST_PROBE, PROBE_EVERY, AutoK


def probes_without_k_plus_one(self, batch=1):
    """AutoK.ks_for_round as it was: a speculating run probed only plain decoding."""
    self.rounds += 1
    if batch != self.current.batch:
        self._replan(batch)
    if self.rounds % PROBE_EVERY != FIRST_PROBE:
        return [self.current.k] * batch
    if self.current.k > 0:
        return [0] * batch
    turn = self.rounds // PROBE_EVERY % batch
    return [int(i == turn) for i in range(batch)]


def main(num_prompts: int, passes: int, factor: float) -> None:
    ar = LLM(threads=2)
    engines = {"before": LLM(mode="sd", threads=2), "now": LLM(mode="sd", threads=2)}
    measured = engines["before"].engine.step_strategy.auto_k.costs
    costs = dataclasses.replace(measured, verify_s=tuple(t * (factor if m >= 3 else 1.0)
                                                         for m, t in enumerate(measured.verify_s, start=1)))
    autos = {}
    for name, llm in engines.items():
        auto = AutoK(costs)
        if name == "before":
            auto.ks_for_round = types.MethodType(probes_without_k_plus_one, auto)
        llm.engine.step_strategy.auto_k = autos[name] = auto
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for dataset in ("humaneval", "sharegpt"):
        prompts = [encode(ar, p) for p in load_prompts(dataset, "eval", num_prompts)]
        seconds = {"ar": 0.0, "before": 0.0, "now": 0.0}
        for _ in range(passes):
            for i, prompt in enumerate(prompts):
                order = ["ar", "before", "now"]
                outputs = {}
                for name in order[i % 3 :] + order[: i % 3]:
                    llm = ar if name == "ar" else engines[name]
                    start = time.perf_counter()
                    outputs[name] = llm.generate([prompt], params)[0].token_ids
                    seconds[name] += time.perf_counter() - start
                assert outputs["before"] == outputs["ar"] == outputs["now"]
        print(f"windows of 3+ rows priced {factor}x: {dataset:9s} before {seconds['ar'] / seconds['before']:.3f}x AR, "
              f"now {seconds['ar'] / seconds['now']:.3f}x AR, now / before {seconds['before'] / seconds['now']:.3f}",
              flush=True)
    for name, auto in autos.items():
        total = sum(auto.rounds_by_k.values())
        print(f"  {name}: rounds by k {({k: round(v / total, 2) for k, v in sorted(auto.rounds_by_k.items())})}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
