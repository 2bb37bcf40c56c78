"""Cost of one draft forward against one target forward (the draft-training issue's 1/8 goal).

Both models run in specfork on the same threads: batch 1, one new token after a context of
--context tokens, through the engine's model runner (``specfork.bench.forward``: paged KV
cache, the same kernels as decoding). Reports the median of --repeat forwards for each and
their ratio.

    python benchmarks/bench_draft_cost.py --threads 2
"""

from __future__ import annotations

import argparse

import torch

from specfork import LLM
from specfork.bench.forward import forward_ms
from specfork.loading.resolve import resolve_checkpoint, resolve_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="default", help="draft checkpoint (default: the shipped draft)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    draft = resolve_draft(args.draft, resolve_checkpoint(args.target))
    ms = {}
    for model in (args.target, draft):
        with LLM(model, threads=args.threads, kv_cache_tokens=args.context + 64) as llm:
            ms[model] = forward_ms(llm, args.context, repeat=args.repeat, warmup=5)
    print(f"one decode forward, batch 1, context {args.context}, {args.threads} threads (median of {args.repeat}):")
    print(f"  target {args.target}: {ms[args.target]:.2f} ms")
    print(f"  draft  {draft}: {ms[draft]:.2f} ms")
    print(f"  draft / target = 1/{ms[args.target] / ms[draft]:.1f}")


if __name__ == "__main__":
    main()
