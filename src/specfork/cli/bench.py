"""``specfork bench``: AR, SD, SSD and n-gram side by side (and peers) on the same prompts."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from specfork.bench.settings import SWEEPABLE, BenchSettings
from specfork.cli import schema
from specfork.output_paths import check_output_directory

HELP = "benchmark AR / SD / SSD / n-gram side by side (and peers): table, JSON, Markdown, PNG"
DESCRIPTION = (
    "Run every mode on every dataset (median over --repeat runs after --warmup), "
    "check greedy speculative outputs against AR token for token, and write results.json, "
    "results.md and PNG plots to --out. Peers (transformers, llama.cpp) run on the same "
    "prompts and are skipped with a message when not installed."
)
EPILOG = (
    "sweeps: --sweep 'k=2,3,5;fan_out=1,3' runs the full grid; sweepable: " + ", ".join(SWEEPABLE)
)


def add_arguments(p) -> None:
    schema.add_options(p, BenchSettings)
    p.add_argument("--sweep", default=None, help="grid of overrides, e.g. 'k=2,3,5;fan_out=1,3'")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar (default: on)")


def run(args: argparse.Namespace) -> int:
    from specfork.bench.report import format_table, legend, sum_lines, write_all
    from specfork.bench.runner import parse_sweep, run_benchmark

    settings = BenchSettings(**schema.values(args, BenchSettings))
    check_output_directory(args.out, "--out")
    report = run_benchmark(settings, parse_sweep(args.sweep), progress=args.progress)
    m = report["machine"]
    gpu = f"; GPU: {m['cuda']}" if m.get("cuda") else ""
    print(f"machine: {m['cpu']}, {m['cores']} cores; native kernels: {m['kernels']}{gpu}; commit {m['commit']}")
    print(format_table(report))
    print(textwrap.fill(legend(report), width=120))
    for line in sum_lines(report):
        print(f"tensor parallel: {line}")
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    paths = write_all(report, args.out, args.command_line)
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0
