"""``specfork export-gguf``: an HF Llama checkpoint (e.g. a trained draft) as a GGUF file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "write an HF Llama checkpoint (e.g. a trained draft) as a GGUF file for llama.cpp"
DESCRIPTION = (
    "Write a Llama-architecture HF checkpoint directory as GGUF. The tokenizer "
    "metadata is copied from --vocab-from (for a draft made by train-draft: its target, "
    "by default), so llama.cpp accepts the file as that target's draft model."
)


def add_arguments(p) -> None:
    from specfork.loading.gguf_export import OUT_TYPES

    p.add_argument("checkpoint", help="HF checkpoint directory")
    p.add_argument("output", type=Path, help="the .gguf file to write")
    p.add_argument("--vocab-from", help="GGUF file or alias whose tokenizer is copied "
                   "(default: the target recorded by train-draft, when it is a GGUF)")
    p.add_argument("--outtype", choices=OUT_TYPES, default="q8_0",
                   help="type of the 2-D weights; norms stay f32 (default q8_0)")


def run(args: argparse.Namespace) -> int:
    from specfork.loading.gguf_export import export_gguf

    vocab_from = args.vocab_from
    provenance = Path(args.checkpoint) / "specfork_draft.json"
    if vocab_from is None and provenance.is_file():
        from specfork.loading.resolve import CheckpointFormat, resolve_checkpoint

        target = json.loads(provenance.read_text()).get("target")
        if target and resolve_checkpoint(target).format is CheckpointFormat.GGUF:
            vocab_from = target
    path = export_gguf(args.checkpoint, args.output, vocab_from=vocab_from, out_type=args.outtype)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0
