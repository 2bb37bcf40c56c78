"""``specfork bench-serve``: Poisson arrivals against a running OpenAI-compatible server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specfork.bench.serve_bench import ServeBenchSettings
from specfork.cli import schema
from specfork.output_paths import check_output_directory

HELP = "drive a running server with Poisson arrivals; latency and throughput per request rate"
DESCRIPTION = (
    "Send --num-prompts streaming requests at each --request-rate (Poisson arrivals) to a "
    "running `specfork serve` (or any OpenAI-compatible server) and report throughput, end-to-end "
    "latency, TTFT and TPOT (mean, p50, p99). Results go to --out/<label>.json; the table and plot "
    "there cover every run in that directory, so AR and SSD servers benchmarked with different "
    "--label values are compared side by side."
)


def add_arguments(p) -> None:
    schema.add_options(p, ServeBenchSettings)
    p.add_argument("--out", type=Path, default=Path("bench-serve-results"),
                   help="output directory (default: bench-serve-results)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar (default: on)")


def run(args: argparse.Namespace) -> int:
    from specfork.bench.serve_bench import run_serve_benchmark, table, write_results

    settings = ServeBenchSettings(**schema.values(args, ServeBenchSettings))
    check_output_directory(args.out, "--out")
    result = run_serve_benchmark(settings, progress=args.progress)
    print(table([result]))
    for row in result["rates"]:
        if row["failed"]:
            print(f"{row['failed']} of {row['failed'] + row['completed']} requests failed at rate {row['request_rate']}: "
                  f"{'; '.join(row['errors'])}", file=sys.stderr)
    if not any(row["completed"] for row in result["rates"]):
        print(f"error: no request completed; nothing written to {args.out}", file=sys.stderr)
        return 1
    paths = write_results(result, args.out)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0
