"""What int8 activations cost in quality, next to int16 ones: the next-token distributions of
`--weights native` (int16 activations) and `--weights native-int8` (int8, llama.cpp's precision)
against `--weights fp32` (the same GGUF dequantised to float32, every product in float32), on the
eval prompts followed by the fp32 path's own greedy responses (teacher-forced, so every setting
sees the same text):

    python docs/experiments/activation_precision_kld.py PROMPTS_PER_SET [MODEL]

MODEL (default: the embedded model) may be any GGUF: for k-quant files the native path's error
includes the fp16 rounding of their combined block scales (src/specfork/layers/gguf_blocks.py).

Prints, per dataset and setting, over every response position: mean and 99th-percentile
KL(p_fp32 || p_setting) in nats, the share of positions whose top-1 token equals fp32's, and the
mean over positions of the largest |logit error| relative to the largest |logit| there. (llama.cpp's `perplexity
--kl-divergence` reports the same kind of numbers for its quantisations.) Timing-free.
"""

import sys

import torch

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
from specfork.engine.sequence import Sequence

SETTINGS = ("native", "native-int8")


def all_logits(llm: LLM, tokens: list[int], first: int) -> torch.Tensor:
    """Logits [len(tokens) - first, V] predicting tokens[first + 1:] and one more (one prefill pass)."""
    engine = llm.engine
    seq = Sequence(-1, tokens, SamplingParams(temperature=0.0), torch.Generator())
    engine.block_manager.grow(seq, len(tokens))
    try:
        rows = list(range(first, len(tokens)))
        return engine.runner.forward([seq], [0], [tokens], rows, decode=False).float()
    finally:
        engine.block_manager.free(seq)


def main(num_prompts: int, model: str) -> None:
    reference = LLM(model, weights="fp32", threads=2)
    engines = {w: LLM(model, weights=w, threads=2) for w in SETTINGS}
    params = SamplingParams(temperature=0.0, max_tokens=256)
    for dataset in ("humaneval", "sharegpt"):
        prompts = [encode(reference, p) for p in load_prompts(dataset, "eval", num_prompts)]
        outputs = reference.generate(prompts, params)
        stats = {w: {"kl": [], "top1": [], "err": []} for w in SETTINGS}
        for prompt, out in zip(prompts, outputs, strict=True):
            tokens = prompt + out.token_ids[:-1]
            ref = all_logits(reference, tokens, len(prompt) - 1)
            log_p = torch.log_softmax(ref, -1)
            p = log_p.exp()
            for w in SETTINGS:
                got = all_logits(engines[w], tokens, len(prompt) - 1)
                kl = (p * (log_p - torch.log_softmax(got, -1))).sum(-1)
                stats[w]["kl"].append(kl)
                stats[w]["top1"].append((got.argmax(-1) == ref.argmax(-1)).float())
                stats[w]["err"].append((got - ref).abs().amax(-1) / ref.abs().amax(-1))
        for w in SETTINGS:
            kl, top1, err = (torch.cat(stats[w][m]) for m in ("kl", "top1", "err"))
            print(f"{dataset:9s} {w:12s} positions {len(kl):5d} KL mean {kl.mean():.2e} p99 {kl.quantile(0.99):.2e} "
                  f"max {kl.max():.2e}  top-1 = fp32 {top1.mean():.4f}  max |logit error| / max |logit| mean "
                  f"{err.mean():.2e}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "smollm2-135m")
