"""What logit adjustments and log-probabilities cost AR, with the decode steps taking them into the
native call (``--decode-steps 4``) and one step a call (``--decode-steps 1``, as every such request
decoded until 2026-12-08), timed in one process: the two engines and the settings alternating
request by request (the order reversed every other request), each request seeded, every output of
the two engines compared (tokens and log-probabilities).

    python docs/experiments/decode_steps_settings_ab.py [PROMPTS_PER_SET] [TEMPERATURE]

Defaults: 3 HumanEval and 3 ShareGPT eval prompts, 256 tokens each (EOS ignored), temperature 1
with top-p 0.95. Prints each setting's median tok/s on each engine and its ratio to the
unadjusted requests' at four steps a call.
"""

import statistics
import sys
import time

import torch

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts

SETTINGS = {
    "none": {},
    "repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "frequency 0.3, presence 0.3": {"frequency_penalty": 0.3, "presence_penalty": 0.3},
    "min_p 0.05": {"min_p": 0.05},
    "logprobs 5": {"logprobs": 5},
}


def main() -> None:
    per_set = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    temperature = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    torch.set_num_threads(2)
    engines = {steps: LLM(threads=2, prefix_caching=False, decode_steps=steps) for steps in (4, 1)}
    prompts = [encode(engines[4], p) for ds in ("humaneval", "sharegpt") for p in load_prompts(ds, "eval", per_set)]
    runs = [(name, steps) for name in SETTINGS for steps in engines]
    rates = {run: [] for run in runs}
    for i, prompt in enumerate(prompts):
        outputs = {}
        for name, steps in runs if i % 2 == 0 else runs[::-1]:
            params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, max_tokens=256,
                                    ignore_eos=True, seed=i, **SETTINGS[name])
            start = time.perf_counter()
            out = engines[steps].generate([prompt], params)[0]
            rates[(name, steps)].append(len(out.token_ids) / (time.perf_counter() - start))
            outputs[(name, steps)] = out.token_ids, out.logprobs
        for name in SETTINGS:
            assert outputs[(name, 4)] == outputs[(name, 1)], (name, i)
    base = statistics.median(rates[("none", 4)])
    for name in SETTINGS:
        four, one = (statistics.median(rates[(name, steps)]) for steps in (4, 1))
        print(f"temperature {temperature}, {name}: 4 steps a call {four:.1f} tok/s ({four / base:.3f}x unadjusted), "
              f"1 step a call {one:.1f} tok/s ({one / base:.3f}x)")


if __name__ == "__main__":
    main()
