"""Plain decoding at several --decode-steps, timed in one process: one engine per setting, the
engines alternating request by request (the order reversed every other request, so a noisy
neighbour hits them alike), every output checked equal to the one-step engine's.

    python docs/experiments/decode_steps_ab.py [PROMPTS_PER_SET] [STEPS,...] [TEMPERATURE]

Defaults: 6 HumanEval and 6 ShareGPT eval prompts, 256 tokens each (EOS ignored), two passes,
settings 1,2,4,8, greedy (temperature 0). At a temperature above 0 every request samples with
top-p 0.95 and its own seed, the same in every engine. Prints each setting's median tok/s over the
requests and its ratio to 1's. (Until 2026-12-07 the option was --greedy-steps and this script
greedy_steps_ab.py, greedy only.)
"""

import statistics
import sys
import time

import torch

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts


def main() -> None:
    per_set = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    settings = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 8]
    temperature = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    if settings[0] != 1:
        settings = [1, *settings]
    torch.set_num_threads(2)
    engines = {g: LLM(decode_steps=g, threads=2, prefix_caching=False) for g in settings}
    prompts = [encode(engines[1], p) for ds in ("humaneval", "sharegpt")
               for p in load_prompts(ds, "eval", per_set)]
    rates = {g: [] for g in settings}
    first = {}
    for rep in range(2):
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0,
                                    max_tokens=256, ignore_eos=True, seed=i if temperature else None)
            for g in settings if (rep + i) % 2 == 0 else settings[::-1]:
                start = time.perf_counter()
                out = engines[g].generate([prompt], params)[0]
                rates[g].append(len(out.token_ids) / (time.perf_counter() - start))
                if first.setdefault(i, out.token_ids) != out.token_ids:
                    raise SystemExit(f"decode_steps={g} gave other tokens than decode_steps=1 on prompt {i}")
    base = statistics.median(rates[1])
    for g in settings:
        rate = statistics.median(rates[g])
        print(f"decode_steps={g}: median {rate:.1f} tok/s ({rate / base:.3f}x of 1)")


if __name__ == "__main__":
    main()
