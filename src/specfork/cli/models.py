"""``specfork models``: the model aliases and shipped drafts, with their files."""

from __future__ import annotations

import argparse
from pathlib import Path

from specfork.errors import SpecforkError

HELP = "list the model aliases, shipped drafts and lookup corpora, with their file paths"
DESCRIPTION = (
    "Print each model alias (usable as --model NAME) with the file it stands for, the "
    "drafts shipped with specfork (used by --mode sd|ssd when --draft is not given) and the "
    "corpus of the target's responses that SD's prompt lookup searches (--lookup-corpus)."
)


def run(args: argparse.Namespace) -> int:
    from specfork.loading.resolve import (
        ALIASES,
        SHIPPED_DRAFTS,
        resolve_checkpoint,
        resolve_corpus,
        shipped_drafts_dir,
    )

    for alias in ALIASES:
        try:
            location = resolve_checkpoint(alias)
            where = str(location.path)
        except SpecforkError as e:
            location, where = None, f"unavailable: {e}"
        print(f"{alias}\t{where}")
        for target, drafts in SHIPPED_DRAFTS.items():
            if where.endswith(target):
                present = [d for d in drafts if (shipped_drafts_dir() / d).exists()]
                for rank, draft in enumerate(present):  # the first is the default (for SSD: the first model)
                    role = "default draft" if rank == 0 else "draft"
                    print(f"  {role}\t{Path(draft).stem}\t{shipped_drafts_dir() / draft}")
        corpus = resolve_corpus(None, location) if location is not None else None
        if corpus is not None:
            print(f"  lookup corpus\t{corpus.stem}\t{corpus}")
    return 0
