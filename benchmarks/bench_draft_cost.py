"""Cost of one draft forward against one target forward (the draft-training issue's 1/8 goal).

Both models run in specfork on the same threads: batch 1, one new token after a context of
--context tokens, through the engine's model runner (paged KV cache, the same kernels as
decoding). Reports the median of --repeat forwards for each and their ratio.

    python benchmarks/bench_draft_cost.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specfork import LLM, SamplingParams
from specfork.engine.sequence import Sequence
from specfork.loading.resolve import resolve_checkpoint, resolve_draft


def forward_ms(model: str, context: int, repeat: int, threads: int) -> float:
    llm = LLM(model, threads=threads, kv_cache_tokens=context + repeat + 64)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.loaded.arch.vocab_size, (context,), generator=gen).tolist()
    seq = Sequence(-1, prompt, SamplingParams(temperature=0.0), torch.Generator())
    engine.block_manager.grow(seq, context + repeat + 1)
    times = []
    try:
        engine.runner.forward([seq], [0], [prompt], [context - 1])
        for i in range(repeat + 5):
            start = time.perf_counter()
            engine.runner.forward([seq], [context + i], [[prompt[i]]], [0])
            if i >= 5:
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        engine.block_manager.free(seq)
    return statistics.median(times)


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
    target_ms = forward_ms(args.target, args.context, args.repeat, args.threads)
    draft_ms = forward_ms(draft, args.context, args.repeat, args.threads)
    print(f"one decode forward, batch 1, context {args.context}, {args.threads} threads (median of {args.repeat}):")
    print(f"  target {args.target}: {target_ms:.2f} ms")
    print(f"  draft  {draft}: {draft_ms:.2f} ms")
    print(f"  draft / target = 1/{target_ms / draft_ms:.1f}")


if __name__ == "__main__":
    main()
