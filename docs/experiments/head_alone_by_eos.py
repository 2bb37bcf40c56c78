"""EAGLE-3 heads alone (k 5, no lookup, no floor) on the eval prompts, with EOS ignored and stopping at
EOS: mean accepted length, acceptance by position, and the share of AR's output tokens inside each
head's draft vocabulary; greedy outputs checked against AR's (src/specfork/drafts/README.md, stage 9):

    python docs/experiments/head_alone_by_eos.py HEAD_DIR[,HEAD_DIR...] PROMPTS [K]

With K, each head runs as SD's default draft does (prompt lookup first, the shipped lookup corpus,
the confidence floor) with k fixed at K instead (issue 17 measures accepted length at k <= 6).
Accepted lengths do not depend on timing, so this may share the machine with other work.
"""

import sys
from pathlib import Path

import torch

from specfork import LLM, SamplingParams
from specfork.config import DEFAULT_DRAFT_CONFIDENCE, DEFAULT_LOOKUP_FIRST
from specfork.datasets import encode, load_prompts
from specfork.loading.eagle3 import draft_to_target, load_eagle3_tensors, read_eagle3_config
from specfork.outputs import aggregate_metrics

ALONE = {"mode": "sd", "k": 5, "lookup_first": 0, "draft_confidence": 0.0, "lookup_corpus": "none", "threads": 2}
# SD's defaults for the shipped head, which a head given by path does not get unasked.
DEFAULTS = {"mode": "sd", "lookup_first": DEFAULT_LOOKUP_FIRST, "draft_confidence": DEFAULT_DRAFT_CONFIDENCE,
            "lookup_corpus": "default", "threads": 2}


def main(heads: list[str], num_prompts: int, k: int | None) -> None:
    ar = LLM(threads=2)
    settings = ALONE if k is None else {**DEFAULTS, "k": k}
    engines = {h: LLM(draft=h, **settings) for h in heads}
    vocab = {h: draft_to_target(load_eagle3_tensors(Path(h)), read_eagle3_config(Path(h))) for h in heads}
    for dataset in ("humaneval", "sharegpt"):
        prompts = [encode(ar, p) for p in load_prompts(dataset, "eval", num_prompts)]
        for ignore_eos in (True, False):
            params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=ignore_eos)
            reference = [o.token_ids for o in ar.generate(prompts, params)]
            tokens = torch.tensor([t for ids in reference for t in ids])
            for h in heads:
                outputs = engines[h].generate(prompts, params)
                agg = aggregate_metrics(outputs)
                inside = float(torch.isin(tokens, vocab[h]).float().mean())
                same = all(o.token_ids == ids for o, ids in zip(outputs, reference, strict=True))
                print(f"{dataset:9s} {'ignore_eos' if ignore_eos else 'to EOS':10s} {Path(h).name:22s} "
                      f"accept {agg['mean_accepted_length']:.3f} by position "
                      f"{[round(x, 3) for x in agg['acceptance_by_position']]} in draft vocab {inside:.3f} = AR {same}",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
