"""Thread scaling of the target's forward (issue 18): a decode step (1 row) and verification
windows (2..--max-rows rows) after --context cached tokens, at each thread count of --threads,
timed interleaved (every repeat runs every thread count, so a noisy neighbour hits them alike).

What it answers: how much a verification window costs over a decode step ("verify nearly
free"), and what SSD costs the target on a machine where the drafter takes one of its cores
(the target's 1-thread time over its 2-thread time). With several --weights (e.g.
native,native-int8) each is loaded once and timed in the same interleaved rounds.

    python benchmarks/bench_threads.py --threads 1,2
    python benchmarks/bench_threads.py --threads 2 --weights native,native-int8
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import torch

from specfork import LLM
from specfork.bench.forward import prefilled
from specfork.bench.timing import median, timed
from specfork.native_kernels import instruction_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts (default: 1,2)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--max-rows", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--weights", default="native", help="comma list of --weights settings (default: native)")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    settings = args.weights.split(",")
    rows = list(range(1, args.max_rows + 1))
    times: dict[tuple[str, int, int], list[float]] = {(w, t, m): [] for w in settings for t in threads for m in rows}
    with ExitStack() as stack:
        forwards = {}
        for w in settings:
            llm = LLM(args.model, threads=max(threads), kv_cache_tokens=args.context + 4096, weights=w)
            forwards[w] = stack.enter_context(prefilled(llm, args.context, args.max_rows))
        for i in range(args.repeat + 2):  # the first two rounds warm up
            for t in threads:
                torch.set_num_threads(t)
                for m in rows:
                    for w, forward in forwards.items():
                        seconds = timed(forward, m)[1]
                        if i >= 2:
                            times[(w, t, m)].append(seconds)
    ms = {key: median(v) * 1e3 for key, v in times.items()}
    print(f"{args.model}, context {args.context}, native kernels {instruction_set()}; median of {args.repeat}")
    for w in settings:
        print(f"--weights {w}")
        print("rows  " + "  ".join(f"{t} thr ms  vs 1 row" for t in threads)
              + "".join(f"  {threads[0]}/{t} thr" for t in threads[1:]))
        for m in rows:
            cells = "  ".join(f"{ms[(w, t, m)]:8.2f}  {ms[(w, t, m)] / ms[(w, t, 1)]:7.2f}x" for t in threads)
            ratios = "".join(f"  {ms[(w, threads[0], m)] / ms[(w, t, m)]:8.2f}x" for t in threads[1:])
            print(f"{m:4d}  {cells}{ratios}")

if __name__ == "__main__":
    main()
