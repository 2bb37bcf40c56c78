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

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
from specfork.speculative.auto_k import FIRST_PROBE, PROBE_EVERY, AutoK


def without_k_plus_one_probes(auto: AutoK) -> None:
    """Make ``auto`` probe as k auto did before: while speculating, plain decoding only."""
    current = auto.ks_for_round

    def ks_for_round(batch: int = 1) -> list[int]:
        ks = current(batch)
        k = auto.current.k  # after any replanning the call did
        probe = auto.rounds % PROBE_EVERY == FIRST_PROBE
        return [0] * batch if probe and k > 0 and ks == [k + 1] * batch else ks

    auto.ks_for_round = ks_for_round


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
            without_k_plus_one_probes(auto)
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
