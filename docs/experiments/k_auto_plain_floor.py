"""k auto against AR and against its own floor, in one process: AR, SD at its defaults (k auto)
and SD forced to plain decoding (k auto's choice replaced by k = 0 for every round, so every round
is a plain pass through SD: feature capture, the head's catch-up, bookkeeping), timed batch by
batch with the engines alternating (docs/benchmarks.md, "batch 8, rechecked"):

    python docs/experiments/k_auto_plain_floor.py TEMPERATURE BATCH PROMPTS REPEATS
    python docs/experiments/k_auto_plain_floor.py 1.0 8 8 4
"""

import sys
import time

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts


def main(temperature: float, batch: int, num_prompts: int, repeats: int) -> None:
    engines = {"ar": LLM(threads=2, max_num_seqs=batch), "auto": LLM(mode="sd", threads=2, max_num_seqs=batch),
               "k0": LLM(mode="sd", threads=2, max_num_seqs=batch)}
    engines["k0"].engine.step_strategy.auto_k.ks_for_round = lambda b=1: [0] * b
    params = SamplingParams(temperature=temperature, max_tokens=256, ignore_eos=True, seed=0)
    for dataset in ("humaneval", "sharegpt"):
        ids = [encode(engines["ar"], p) for p in load_prompts(dataset, "eval", num_prompts)]
        groups = [ids[i : i + batch] for i in range(0, len(ids), batch)]
        for llm in engines.values():  # warm-up
            llm.generate(groups[0][:1], SamplingParams(temperature=temperature, max_tokens=16, seed=0))
        engines["auto"].engine.step_strategy.auto_k.rounds_by_k.clear()  # this dataset's rounds only
        seconds = dict.fromkeys(engines, 0.0)
        tokens = dict.fromkeys(engines, 0)
        names = list(engines)
        for r in range(repeats):
            for g, group in enumerate(groups):
                shift = (r + g) % len(names)  # each engine takes each place in the order in turn
                for name in names[shift:] + names[:shift]:
                    llm = engines[name]
                    t = time.perf_counter()
                    outs = llm.generate(group, params)
                    seconds[name] += time.perf_counter() - t
                    tokens[name] += sum(len(o.token_ids) for o in outs)
        ar = tokens["ar"] / seconds["ar"]
        rates = ", ".join(f"{n} {tokens[n] / seconds[n]:.1f} ({tokens[n] / seconds[n] / ar:.3f}x)" for n in engines)
        rounds = dict(engines["auto"].engine.step_strategy.auto_k.rounds_by_k)
        sys.stdout.write(f"{dataset} T={temperature} batch {batch} x{repeats}: {rates}\n  k auto's rounds: {rounds}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
