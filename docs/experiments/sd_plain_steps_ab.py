"""SD (the shipped head, k auto) against AR, with SD's plain rounds at --decode-steps 4 and at 1, timed
in one process: the three engines alternating request by request (the order reversed every other
request), each request seeded.

    python docs/experiments/sd_plain_steps_ab.py TEMPERATURE [PROMPTS_PER_SET] [plain]

Defaults: 4 HumanEval and 4 ShareGPT eval prompts, 256 tokens each (EOS ignored), top-p 0.95 at a
temperature above 0. With ``plain``, k auto's choice is replaced by plain decoding in every round
(SD's plain rounds alone; until 2026-12-07 sd_plain_rounds_forced.py, 3 prompts per set). Prints
each engine's median tok/s and its ratio to AR's, and the share of each SD engine's rounds (a plain
round per token) that proposed nothing.
"""

import statistics
import sys
import time

import torch

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts


def main() -> None:
    temperature = float(sys.argv[1])
    per_set = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    every_round_plain = len(sys.argv) > 3 and sys.argv[3] == "plain"
    torch.set_num_threads(2)
    engines = {"ar": LLM(threads=2, prefix_caching=False),
               "sd": LLM(mode="sd", threads=2, prefix_caching=False),
               "sd, decode_steps=1": LLM(mode="sd", threads=2, prefix_caching=False, decode_steps=1)}
    if every_round_plain:
        for name, llm in engines.items():
            if name != "ar":
                llm.engine.step_strategy.auto_k.ks_for_round = lambda batch=1: [0] * batch
    prompts = [encode(engines["ar"], p) for ds in ("humaneval", "sharegpt")
               for p in load_prompts(ds, "eval", per_set)]
    rates = {name: [] for name in engines}
    plain = {name: [0, 0] for name in engines if name != "ar"}  # rounds without drafts, rounds
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=256,
                                ignore_eos=True, seed=i)
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            out = engines[name].generate([prompt], params)[0]
            rates[name].append(len(out.token_ids) / (time.perf_counter() - start))
            if name != "ar":
                plain[name][0] += out.metrics["spec_rounds_without_drafts"]
                plain[name][1] += out.metrics["spec_rounds"]
    base = statistics.median(rates["ar"])
    label = f"temperature {temperature}" + (", every round plain" if every_round_plain else "")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{label}: {name}: median {rate:.1f} tok/s ({rate / base:.3f}x AR)")
    for name, (none, rounds) in plain.items():
        print(f"{name}: rounds without drafts {none} of {rounds} ({none / max(rounds, 1):.0%})")


if __name__ == "__main__":
    main()
