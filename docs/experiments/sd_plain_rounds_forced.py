"""SD's plain rounds alone: SD (the shipped head) with k auto's choice replaced by plain decoding in
every round, at --decode-steps 4 and at 1, against AR, timed in one process (the engines alternating
request by request, each request seeded).

    python docs/experiments/sd_plain_rounds_forced.py TEMPERATURE

3 HumanEval and 3 ShareGPT eval prompts, 256 tokens each (EOS ignored), top-p 0.95 at a temperature
above 0. Prints each engine's median tok/s and its ratio to AR's.
"""

import statistics
import sys
import time

import torch

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts


def main() -> None:
    temperature = float(sys.argv[1])
    torch.set_num_threads(2)
    engines = {"ar": LLM(threads=2, prefix_caching=False),
               "sd, decode_steps=4": LLM(mode="sd", threads=2, prefix_caching=False),
               "sd, decode_steps=1": LLM(mode="sd", threads=2, prefix_caching=False, decode_steps=1)}
    for name, llm in engines.items():
        if name != "ar":
            llm.engine.step_strategy.auto_k.ks_for_round = lambda batch=1: [0] * batch
    prompts = [encode(engines["ar"], p) for ds in ("humaneval", "sharegpt")
               for p in load_prompts(ds, "eval", 3)]
    rates = {name: [] for name in engines}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=256,
                                ignore_eos=True, seed=i)
        for name in list(engines) if i % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            out = engines[name].generate([prompt], params)[0]
            rates[name].append(len(out.token_ids) / (time.perf_counter() - start))
    base = statistics.median(rates["ar"])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"temperature {temperature}, every round plain: {name}: median {rate:.1f} tok/s "
              f"({rate / base:.3f}x AR)")


if __name__ == "__main__":
    main()
