"""A head's draft vocabulary widened without training, to measure how much the ids it cannot propose
cost (docs/decisions.md, 2026-11-29): every id the head has keeps its trained LM-head row, and the
most frequent ids of the shipped lookup corpus (the target's responses to training prompts) that it
lacks are added, each with the target's row mapped by the least-squares readout ``--reselect-draft-vocab``
gives new ids (`training.eagle3_pipeline.carried_over`). The heads are written to OUT_DIR/eagle3-vN;
measure them with head_alone_by_eos.py:

    python docs/experiments/widen_draft_vocab.py HEAD_DIR SIZES OUT_DIR      (SIZES: e.g. 8192,16384)
"""

import dataclasses
import sys
from pathlib import Path

import torch

from specfork import LLM
from specfork.loading.eagle3 import save_eagle3
from specfork.training.eagle3_features import corpus_token_counts
from specfork.training.eagle3_head import target_head_rows
from specfork.training.eagle3_pipeline import carried_over, coverage_of, initial_head

CORPUS = Path(__file__).resolve().parents[2] / "src/specfork/drafts/smollm2-135m-corpus.npz"


def main(head_dir: Path, sizes: list[int], out_dir: Path) -> None:
    target = LLM(threads=2).engine.loaded
    init = initial_head(head_dir, target)
    counts = corpus_token_counts(CORPUS, target.arch.vocab_size)
    old_rows = target_head_rows(target.model, init.draft_ids)
    print(f"{head_dir.name}: {len(init.draft_ids)} ids, {coverage_of(init.draft_ids, counts):.4f} of the corpus")
    for size in sizes:
        rank = counts.double()
        rank[init.draft_ids] = float("inf")  # the head's own ids first, then by frequency
        ids = torch.sort(-rank, stable=True).indices[:size].sort().values
        tensors = carried_over(init, ids, target_head_rows(target.model, ids), old_rows)
        out = out_dir / f"eagle3-v{size}"
        save_eagle3(out, dataclasses.replace(init.config, draft_vocab_size=size), tensors, ids)
        print(f"{out}: {size} ids, {coverage_of(ids, counts):.4f} of the corpus")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], Path(sys.argv[3]))
