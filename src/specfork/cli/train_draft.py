"""``specfork train-draft``: distil a small draft model or an EAGLE-3 head from the target's own outputs."""

from __future__ import annotations

import argparse
import json
import sys

from specfork.cli import schema
from specfork.training.settings import DataSettings, DraftArch, Eagle3Settings, TrainDraftJob, TrainSettings

HELP = "train a small draft model or an EAGLE-3 head for a target (distilled from the target's own outputs)"
DESCRIPTION = (
    "Train a Llama-architecture draft sharing the target's vocabulary: the target "
    "answers training prompts from ShareGPT's train split (chat turns and code-block "
    "prefixes), the draft learns to predict its tokens, and a final SD run on held-out "
    "prompts reports the mean accepted length. With --kind eagle3 it trains an EAGLE-3 head "
    "instead: one decoder layer reading the target's hidden states, trained with training-time "
    "test on features captured from the target. Everything is kept under --work-dir, so "
    "running the same command again resumes an interrupted run, and a run with a larger "
    "--num-prompts in the same work dir answers and prefills only the new prompts (and trains "
    "afresh on them all: a checkpoint resumes only on the data it was trained on). The target's "
    "responses are also written there as lookup_corpus.npz, for SD's --lookup-corpus."
)


def add_arguments(p) -> None:
    for settings in (TrainDraftJob, DataSettings, DraftArch, TrainSettings, Eagle3Settings):
        schema.add_options(p, settings)


def run(args: argparse.Namespace) -> int:
    train = TrainSettings(**schema.values(args, TrainSettings))
    job = TrainDraftJob(
        **schema.values(args, TrainDraftJob),
        data=DataSettings(**schema.values(args, DataSettings), seed=train.seed),
        arch=DraftArch(**schema.values(args, DraftArch)),
        train=train,
        eagle3=Eagle3Settings(**schema.values(args, Eagle3Settings)),
    )
    from specfork.training.pipeline import train_draft

    try:
        result = train_draft(job, command=args.command_line)
    except KeyboardInterrupt:
        print(f"\nstopped; the same command resumes from what is kept in {job.work_dir} (the last checkpoint, "
              "every finished shard of answers and features)", file=sys.stderr)
        raise
    print(json.dumps({k: result[k] for k in ("first_loss", "last_loss", "eval_top1_agreement", "eval", "acceptance")
                      if k in result}, indent=2))
    print(f"{'EAGLE-3 head' if job.kind == 'eagle3' else 'draft'} written to {job.output}", file=sys.stderr)
    return 0
