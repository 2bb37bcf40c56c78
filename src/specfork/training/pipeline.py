"""``specfork train-draft``: data generation, training, saving, and a final acceptance check.

Everything lives under ``work_dir`` (``data/`` shards, ``checkpoints/``), so running the same
command again after an interruption resumes: finished shards are kept, training continues
from its last checkpoint.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specfork.errors import SpecforkError
from specfork.training.data import generate_examples, training_prompts, without_earlier
from specfork.training.settings import TrainDraftJob
from specfork.training.trainer import (
    DraftTrainer,
    build_draft,
    evaluate_tokens,
    save_draft,
)

logger = logging.getLogger(__name__)

LOOKUP_CORPUS = "lookup_corpus.npz"  # under --work-dir: the target's responses, for --lookup-corpus


def generate_data(job: TrainDraftJob, llm) -> list:
    d = job.data
    manifest = {"target": job.target, **asdict(d)}
    prompts = training_prompts(d.num_prompts, d.seed, d.code_fraction)
    if len(prompts) < d.num_prompts:
        logger.warning("only %d training prompts available (asked for %d)", len(prompts), d.num_prompts)
    if d.skip_prompts:
        prompts = without_earlier(prompts, d.skip_prompts, d.seed, d.code_fraction)
        logger.info("training on %d prompts: those of the first %d of %d are left out", len(prompts), d.skip_prompts,
                    d.num_prompts)
    return generate_examples(
        llm,
        prompts,
        job.work_dir / "data",
        max_new_tokens=d.max_new_tokens,
        max_prompt_tokens=d.max_prompt_tokens,
        manifest=manifest,
        shard_size=d.shard_size,
        progress=job.progress,
    )


def target_responses(job: TrainDraftJob):
    """Set the threads, load the target, generate (or resume) its responses and write them as the
    lookup corpus: (the target's LLM, the examples, the job's start time, the seconds data
    generation took, the corpus's record for the provenance)."""
    if job.threads:
        torch.set_num_threads(job.threads)
    started = time.time()
    llm = target_llm(job)
    if job.eval_prompts and job.eval_tokens >= llm.max_model_len:
        raise SpecforkError(f"--eval-tokens {job.eval_tokens} leaves no room for a prompt in the target's context "
                            f"({llm.max_model_len} tokens); lower it, or skip the check with --eval-prompts 0")
    t0 = time.time()
    examples = generate_data(job, llm)
    corpus = write_lookup_corpus(job.work_dir / LOOKUP_CORPUS, examples, llm.engine.loaded.arch.vocab_size)
    return llm, examples, started, time.time() - t0, corpus


def write_lookup_corpus(path: Path, examples: list, vocab_size: int) -> dict:
    """The target's responses (each distinct prompt's once) as a corpus for prompt lookup
    (``--lookup-corpus``, speculative/corpus.py)."""
    from specfork.speculative.corpus import save_corpus

    responses = {tuple(e.prompt_ids): e.response_ids for e in examples}
    tokens = save_corpus(path, list(responses.values()), vocab_size)
    logger.info("lookup corpus: %d response tokens written to %s (use it with --lookup-corpus)", tokens, path)
    return {"path": str(path), "tokens": tokens}


def target_llm(job: TrainDraftJob):
    from specfork import LLM

    d = job.data
    return LLM(
        job.target,
        device=job.device,
        threads=job.threads,
        max_num_seqs=job.generation_batch,
        kv_cache_tokens=job.generation_batch * (d.max_prompt_tokens + d.max_new_tokens + 16),
    )


def acceptance_check(job: TrainDraftJob) -> dict:
    """Mean accepted length of greedy SD (k = 5) with the new draft on held-out prompts."""
    from specfork import LLM, SamplingParams
    from specfork.datasets import encode, load_prompts
    from specfork.outputs import aggregate_metrics

    if job.eval_prompts < 1:
        return {}
    llm = LLM(job.target, device=job.device, threads=job.threads, mode="sd", draft=str(job.output), k=5)
    params = SamplingParams(temperature=0.0, max_tokens=job.eval_tokens, ignore_eos=True)
    result = {}
    for dataset in ("humaneval", "sharegpt"):
        prompts = load_prompts(dataset, "eval", job.eval_prompts)
        outputs = llm.generate([encode(llm, p) for p in prompts], params)
        agg = aggregate_metrics(outputs)
        result[dataset] = {
            "prompts": len(prompts),
            "tokens_per_prompt": job.eval_tokens,
            "mean_accepted_length": agg["mean_accepted_length"],
            "acceptance_rate": agg["acceptance_rate"],
        }
    return result


def train_draft(job: TrainDraftJob, command: str = "") -> dict:
    """Run the whole job; returns the provenance written next to the draft."""
    if job.kind == "eagle3":
        from specfork.training.eagle3_pipeline import train_eagle3

        return train_eagle3(job, command)
    llm, examples, started, data_seconds, corpus = target_responses(job)
    tokenizer = llm.tokenizer
    target = llm.engine.loaded
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    torch.manual_seed(job.train.seed)
    model = build_draft(target, job.arch)
    del llm
    device = torch.device(job.device)
    trainer = DraftTrainer(model, examples, job.train, job.work_dir / "checkpoints", pad_id, device)
    trainer.try_resume()
    t0 = time.time()
    history = trainer.run(progress=job.progress)
    train_seconds = time.time() - t0
    metrics = evaluate_tokens(trainer.model, trainer.held_out, job.train, pad_id, device)
    first = history[: max(1, len(history) // 20)]
    last = history[-max(1, len(history) // 20) :]
    provenance = {
        "kind": "draft",
        "target": job.target,
        "command": command,
        "data": asdict(job.data),
        "arch": asdict(job.arch),
        "train": asdict(job.train),
        "examples": {"train": len(trainer.train), "held_out": len(trainer.held_out)},
        "lookup_corpus": corpus,
        "response_tokens": sum(len(e.response_ids) for e in examples),
        "train_steps": trainer.step,
        "first_loss": sum(r["loss"] for r in first) / len(first),
        "last_loss": sum(r["loss"] for r in last) / len(last),
        **metrics,
        "data_seconds_this_run": round(data_seconds, 1),
        "train_seconds_this_run": round(train_seconds, 1),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "device": job.device},
        "torch": torch.__version__,
    }
    save_draft(trainer.model.cpu(), tokenizer.hf if tokenizer is not None else None, job.output, provenance,
               progress=job.progress)
    provenance["acceptance"] = acceptance_check(job)
    provenance["total_seconds_this_run"] = round(time.time() - started, 1)
    save_draft_provenance(job.output, provenance)
    return provenance


def save_draft_provenance(output: Path, provenance: dict) -> None:
    import json

    (output / "specfork_draft.json").write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str))
