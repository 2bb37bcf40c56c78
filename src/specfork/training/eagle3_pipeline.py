"""``specfork train-draft --kind eagle3``: the target's responses (as for a draft), its features,
the draft vocabulary, TTT training of the head, saving it in the ecosystem's layout, and a final
SD acceptance check.

Everything lives under ``work_dir`` (``data/`` and ``features/`` shards, ``eagle3-checkpoints/``),
so running the same command again after an interruption resumes: finished shards are kept,
training continues from its last checkpoint. The data shards are the draft's: a head trained
with a draft's ``--work-dir`` (and the same data settings) reuses its target responses.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specfork.errors import SpecforkError
from specfork.loading.eagle3 import (
    Eagle3Config,
    check_eagle3_head,
    default_feature_layers,
    draft_to_target,
    load_eagle3_tensors,
    save_eagle3,
)
from specfork.training.eagle3_features import (
    STORE_DTYPE,
    DraftVocab,
    choose_draft_vocab,
    corpus_token_counts,
    count_response_tokens,
    extract_features,
)
from specfork.training.eagle3_head import Eagle3TrainHead, build_head, head_config, target_head_rows
from specfork.training.eagle3_trainer import Eagle3Trainer
from specfork.training.pipeline import acceptance_check, save_draft_provenance, target_responses
from specfork.training.settings import TrainDraftJob
from specfork.training.trainer import is_eval_example, publish_directory

logger = logging.getLogger(__name__)


def train_eagle3(job: TrainDraftJob, command: str = "") -> dict:
    """Run the whole job; returns the provenance written next to the head."""
    llm, examples, started, data_seconds, corpus = target_responses(job)
    target = llm.engine.loaded
    e = job.eagle3
    init = initial_head(e.init_head, target) if e.init_head else None
    layers = init.config.layers_for(target.arch.num_layers) if init else default_feature_layers(target.arch.num_layers)
    t0 = time.time()
    manifest = {"target": job.target, **asdict(job.data), "max_seq_len": job.train.max_seq_len,
                "feature_layers": list(layers), "shard_size": e.shard_size, "dtype": str(STORE_DTYPE)}
    store = extract_features(llm, examples, job.work_dir / "features", layers=layers,
                             max_seq_len=job.train.max_seq_len, batch=e.feature_batch, shard_size=e.shard_size,
                             manifest=manifest, progress=job.progress)
    feature_seconds = time.time() - t0
    counts = count_response_tokens([x for x in examples if not is_eval_example(x)], target.arch.vocab_size)
    if e.draft_vocab_corpus is not None:
        counts += corpus_token_counts(e.draft_vocab_corpus, target.arch.vocab_size)
    if init and e.reselect_draft_vocab:
        vocab = choose_draft_vocab(counts, len(init.draft_ids))
        config = init.config
        logger.info("draft vocabulary chosen anew: %d of the head's %d ids kept (they covered %.1f%% of the "
                    "counted tokens)", int(torch.isin(vocab.ids, init.draft_ids).sum()), len(init.draft_ids),
                    100 * coverage_of(init.draft_ids, counts))
    elif init:
        vocab = DraftVocab(init.draft_ids, coverage_of(init.draft_ids, counts))
        config = init.config
    else:
        vocab = choose_draft_vocab(counts, None if e.draft_vocab == "auto" else e.draft_vocab)
        config = head_config(target.arch, len(vocab.ids), layers, e.head_intermediate_size)
    config.layers_for(target.arch.num_layers)
    logger.info("draft vocabulary: %d of %d target ids, covering %.1f%% of the counted tokens (the training "
                "responses', and --draft-vocab-corpus's if given)",
                len(vocab.ids), target.arch.vocab_size, 100 * vocab.coverage)
    torch.manual_seed(job.train.seed)
    target_rows = target_head_rows(target.model, vocab.ids)  # the loss's target distributions come from these
    head = build_head(target, config, vocab.ids, target_rows)  # a copy: --init-head may overwrite the head's
    if init:
        head.load_state_dict(carried_over(init, vocab.ids, target_rows, target_head_rows(target.model, init.draft_ids)))
        logger.info("starting from the weights of %s", e.init_head)
    del llm, target
    trainer = Eagle3Trainer(head, store, examples, job.train, e, target_rows, job.work_dir / "eagle3-checkpoints",
                            torch.device(job.device))
    trainer.try_resume()
    t0 = time.time()
    history = trainer.run(progress=job.progress)
    train_seconds = time.time() - t0
    final = trainer.curve[-1] if trainer.curve and trainer.curve[-1]["step"] == trainer.step else trainer.evaluate()
    save_head(job.output, config, trainer.head, vocab.ids)
    tail = max(1, len(history) // 20)
    provenance = {
        "kind": "eagle3",
        "target": job.target,
        "command": command,
        "data": asdict(job.data),
        "train": asdict(job.train),
        "eagle3": asdict(e),
        "head": {"feature_layers": list(layers), "intermediate_size": config.arch.intermediate_size,
                 "hidden_size": config.arch.hidden_size, "matmul_dtype": str(trainer.autocast or torch.float32)},
        "draft_vocab": draft_vocab_record(vocab, target_vocab=config.arch.vocab_size),
        "examples": {"train": len(trainer.train), "held_out": len(trainer.held_out)},
        "lookup_corpus": corpus,
        "response_tokens": sum(len(x.response_ids) for x in examples),
        "train_steps": trainer.step,
        "first_loss": sum(r["loss"] for r in history[:tail]) / len(history[:tail]),
        "last_loss": sum(r["loss"] for r in history[-tail:]) / len(history[-tail:]),
        "eval": final,
        "curve": trainer.curve,
        "data_seconds_this_run": round(data_seconds, 1),
        "feature_seconds_this_run": round(feature_seconds, 1),
        "train_seconds_this_run": round(train_seconds, 1),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "device": job.device},
        "torch": torch.__version__,
    }
    save_draft_provenance(job.output, provenance)
    provenance["acceptance"] = head_acceptance(job)
    provenance["total_seconds_this_run"] = round(time.time() - started, 1)
    save_draft_provenance(job.output, provenance)
    return provenance


@dataclass(frozen=True, slots=True)
class InitialHead:
    """A trained head to start from: its config, draft vocabulary and weights (``state_dict`` names)."""

    config: Eagle3Config
    draft_ids: torch.Tensor
    tensors: dict[str, torch.Tensor]


def initial_head(directory: Path, target) -> InitialHead:
    """The head in ``directory``, refused unless it was made for ``target`` and stores all the
    trainable weights in float (``--init-head``)."""
    config = check_eagle3_head(directory, target.arch)
    tensors = load_eagle3_tensors(directory)
    draft_ids = draft_to_target(tensors, config)
    tensors.pop("d2t", None)
    if "embed_tokens.weight" in tensors:
        raise SpecforkError(f"{directory} stores its own embedding; specfork trains heads over the target's")
    return InitialHead(config, draft_ids, {n: t.float() for n, t in tensors.items()})


def carried_over(init: InitialHead, draft_ids: torch.Tensor, target_rows: torch.Tensor,
                 init_target_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``init``'s weights for a head over ``draft_ids`` (target ids): its LM-head row for each id
    it already had; for each new id, the target's row (``target_rows``, one per id of
    ``draft_ids``) mapped into the head's readout by the least-squares matrix that takes the
    target's rows of init's ids (``init_target_rows``) to init's trained rows. Every other weight
    as it is. (A trained head's final hidden state is no longer the target's: its trained rows are
    a linear map of the target's away, cosine 0.85 for the shipped head, and new ids given the
    target's rows as they are outscored the trained ones, top-1 agreement 0.645 -> 0.014; mapped,
    0.645 before any training.)"""
    if torch.equal(draft_ids, init.draft_ids):
        return init.tensors
    trained = init.tensors["lm_head.weight"]
    vocab = int(max(draft_ids.max(), init.draft_ids.max())) + 1
    row_of = torch.full((vocab,), -1, dtype=torch.long)  # target id -> its row in init's LM head
    row_of[init.draft_ids] = torch.arange(len(init.draft_ids))
    old = row_of[draft_ids]
    rows = target_rows @ torch.linalg.lstsq(init_target_rows.double(), trained.double()).solution.to(trained.dtype)
    rows[old >= 0] = trained[old[old >= 0]]
    return {**init.tensors, "lm_head.weight": rows}


def coverage_of(ids: torch.Tensor, counts: torch.Tensor) -> float:
    """The share of the counted tokens whose id is in ``ids``."""
    return float(counts[ids].sum()) / max(1, int(counts.sum()))


def draft_vocab_record(vocab: DraftVocab, target_vocab: int) -> dict:
    return {"size": len(vocab.ids), "target_vocab": target_vocab, "coverage": vocab.coverage}


def save_head(output: Path, config: Eagle3Config, head: Eagle3TrainHead, draft_ids: torch.Tensor) -> None:
    """The head in the ecosystem's layout (fp16 safetensors, config.json, d2t/t2d)."""
    state = {name: t.detach().cpu() for name, t in head.state_dict().items()}
    publish_directory(output, lambda tmp: save_eagle3(tmp, config, state, draft_ids))


def head_acceptance(job: TrainDraftJob) -> dict:
    """SD's acceptance with the new head as the draft, or why it could not be measured."""
    try:
        return acceptance_check(job)
    except Exception as e:  # noqa: BLE001 - any failure to run the head only skips the check
        logger.warning("SD acceptance check skipped: specfork could not run %s as an SD draft (%s: %s)",
                       job.output, type(e).__name__, e)
        return {"skipped": f"{type(e).__name__}: {e}"}
