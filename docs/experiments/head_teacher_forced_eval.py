"""Teacher-forced agreement of an EAGLE-3 head on the target's greedy outputs for the eval prompts: the
trainer's own held-out evaluation (top-1 by unroll step, mean run of 5) run on those sequences,
with EOS ignored (1) or stopping at EOS (0) (docs/decisions.md, stage 9):

    python docs/experiments/head_teacher_forced_eval.py HEAD_DIR PROMPTS IGNORE_EOS
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch

import specfork.training.eagle3_trainer as trainer_module
from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
from specfork.training.data import Example
from specfork.training.eagle3_features import extract_features
from specfork.training.eagle3_head import build_head, target_head_rows
from specfork.training.eagle3_pipeline import initial_head
from specfork.training.eagle3_trainer import Eagle3Trainer
from specfork.training.settings import Eagle3Settings, TrainSettings


def main(head_dir: Path, num_prompts: int, ignore_eos: bool) -> None:
    torch.set_num_threads(2)
    llm = LLM(threads=2)
    target = llm.engine.loaded
    init = initial_head(head_dir, target)
    layers = init.config.layers_for(target.arch.num_layers)
    rows = target_head_rows(target.model, init.draft_ids)
    scratch = Path(tempfile.mkdtemp(prefix="head-eval-"))
    try:
        for dataset in ("humaneval", "sharegpt"):
            prompts = [encode(llm, p) for p in load_prompts(dataset, "eval", num_prompts)]
            outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=ignore_eos))
            examples = [Example(dataset, f"{dataset}{i}", p, o.token_ids)
                        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
            store = extract_features(llm, examples, scratch / dataset, layers=layers, max_seq_len=640, batch=8,
                                     shard_size=64, manifest={"eval": dataset}, progress=False)
            head = build_head(target, init.config, init.draft_ids, rows)
            head.load_state_dict(init.tensors)
            # The trainer needs one training sequence: the first; every other one is evaluated.
            trainer_module.is_eval_example = lambda e, first=examples[0].id: e.id != first
            result = Eagle3Trainer(head, store, examples, TrainSettings(), Eagle3Settings(precision="fp32"), rows,
                                   scratch / "checkpoints", torch.device("cpu")).evaluate()
            print(f"{dataset} {'ignore_eos' if ignore_eos else 'to EOS'} positions {result['positions']} top-1 by step "
                  f"{[round(x, 3) for x in result['top1_by_step']]} mean run {result['mean_accepted_run']:.3f}",
                  flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
