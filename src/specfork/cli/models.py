"""``specfork models``: the model aliases and shipped drafts, with their files."""

from __future__ import annotations

import argparse

from specfork.errors import SpecforkError

HELP = "list the model aliases and shipped drafts, with their file paths"
DESCRIPTION = (
    "Print each model alias (usable as --model NAME) with the file it stands for, and the "
    "drafts shipped with specfork (used by --mode sd|ssd when --draft is not given)."
)


def run(args: argparse.Namespace) -> int:
    from specfork.loading.resolve import ALIASES, SHIPPED_DRAFTS, resolve_checkpoint, shipped_drafts_dir

    for alias in ALIASES:
        try:
            where = str(resolve_checkpoint(alias).path)
        except SpecforkError as e:
            where = f"unavailable: {e}"
        print(f"{alias}\t{where}")
        for target, draft in SHIPPED_DRAFTS.items():
            if where.endswith(target):
                print(f"  default draft\t{shipped_drafts_dir() / draft}")
    return 0
