"""The native paged-attention kernel alone (issue 18): a decode step (1 query) and verification
windows (2..--max-rows consecutive queries of one sequence) after --contexts cached tokens, with
the embedded model's heads (9 query heads, 3 KV heads, head size 64), over one KV cache per layer
(30 layers, so the cache is read from memory as in a forward, not from a warm cache), for a
float32 and a float16 cache. Every setting is timed in every repeat (interleaved).

    python benchmarks/bench_attention.py --threads 2
"""

from __future__ import annotations

import argparse

import torch

from specfork.bench.machine import native_kernels_or_exit
from specfork.bench.timing import median, timed
from specfork.layers.attention import new_kv_cache

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="256,1024", help="comma list of cached tokens (default: 256,1024)")
    parser.add_argument("--max-rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    k = native_kernels_or_exit()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = list(range(1, args.max_rows + 1))
    dtypes = {"float32": torch.float32, "float16": torch.float16}
    calls = {}
    for ctx in contexts:
        blocks = (ctx + args.max_rows) // BLOCK + 1
        table = torch.arange(blocks).view(1, -1)
        for name, dtype in dtypes.items():
            caches = [new_kv_cache(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype).normal_(generator=gen) for _ in range(LAYERS)]
            for m in rows:
                q = torch.randn(m, HEADS, HEAD_DIM, generator=gen)
                seq, pos = torch.zeros(m, dtype=torch.long), torch.arange(ctx, ctx + m)

                def forward(q=q, seq=seq, pos=pos, caches=caches, table=table):
                    for cache in caches:
                        k.paged_attention_decode(q, cache, table, seq, pos, HEAD_DIM**-0.5)

                calls[(ctx, name, m)] = forward
    times = {key: [] for key in calls}
    for i in range(args.repeat + 2):  # the first two rounds warm up
        for key, forward in calls.items():
            seconds = timed(forward)[1]
            if i >= 2:
                times[key].append(seconds)
    print(f"{LAYERS} layers' attention, {HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, {args.threads} threads; "
          f"median of {args.repeat}, ms per forward")
    for ctx in contexts:
        for name in dtypes:
            base = median(times[(ctx, name, 1)])
            cells = "  ".join(f"{m}: {median(times[(ctx, name, m)]) * 1e3:5.2f} ({median(times[(ctx, name, m)]) / base:.2f}x)"
                              for m in rows)
            print(f"context {ctx:5d} {name}  {cells}")


if __name__ == "__main__":
    main()
