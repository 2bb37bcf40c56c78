"""What an EAGLE-3 head learns from: the target's features and final hidden states of each
training sequence, and the head's reduced draft vocabulary.

Features come from one target prefill per sequence (several sequences per pass): the inputs of
the feature layers, [n, 3d], and the final normed hidden state, [n, d], from which the loss
derives the target's next-token distribution over the draft vocabulary (full logits are never
stored). They are written in fp16 shards under ``features/``, each as soon as it is done, and
found again by the sequence's token ids, so an interrupted run keeps its finished shards and a run
over more examples computes only the new ones. A shard is read back memory-mapped: a batch
touches only the sequences it holds.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.errors import SpecforkError
from specfork.training.data import Example, check_manifest, load_shard, next_shard_index, shard_path
from specfork.training.settings import DRAFT_VOCAB_SIZES

logger = logging.getLogger(__name__)

DRAFT_VOCAB_COVERAGE = 0.98  # the share of response tokens an automatically sized draft vocabulary covers
STORE_DTYPE = torch.float16


@dataclass(frozen=True, slots=True)
class DraftVocab:
    ids: torch.Tensor  # [N] int64, ascending: the target id of each draft id
    coverage: float  # the share of the counted tokens that are in the vocabulary


def choose_draft_vocab(counts: torch.Tensor, forced: int | None = None, *, sizes: tuple[int, ...] = DRAFT_VOCAB_SIZES,
                       coverage: float = DRAFT_VOCAB_COVERAGE) -> DraftVocab:
    """The ``N`` most frequent target ids of ``counts`` [vocab] (ties: the lower id first).

    ``N`` is ``forced`` or the smallest of ``sizes`` whose most frequent ids cover at least
    ``coverage`` of all counted tokens (else the largest size); never more than the vocabulary.
    Example: counts [5, 0, 3, 2], sizes (1, 2, 4), coverage 0.8 -> N = 2 (8 of 10 tokens), ids [0, 2].
    """
    vocab = counts.numel()
    order = torch.sort(-counts.to(torch.long), stable=True).indices
    cumulative = torch.cumsum(counts[order].double(), 0)
    total = float(cumulative[-1]) if vocab else 0.0
    if forced is not None:
        if forced < 1:
            raise SpecforkError(f"draft vocabulary size must be >= 1, got {forced}")
        n = min(forced, vocab)
    else:
        n = min(next((s for s in sorted(sizes) if s >= vocab or float(cumulative[s - 1]) >= coverage * total),
                     max(sizes)), vocab)
    covered = float(cumulative[n - 1]) / total if total else 1.0
    return DraftVocab(order[:n].sort().values, covered)


def count_response_tokens(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each target id occurs in the examples' responses."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        if e.response_ids:
            counts += torch.bincount(torch.tensor(e.response_ids, dtype=torch.long), minlength=vocab_size)
    return counts


def corpus_token_counts(path: Path, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each id occurs in the lookup corpus ``path``."""
    from specfork.speculative.corpus import SEPARATOR, read_corpus_tokens

    tokens = torch.from_numpy(read_corpus_tokens(path, vocab_size).astype("int64"))
    return torch.bincount(tokens[tokens != SEPARATOR], minlength=vocab_size)


def training_sequence(example: Example, max_seq_len: int) -> tuple[list[int], int]:
    """(token ids, prompt length) of the sequence an example trains on: at most ``max_seq_len``
    tokens, the prompt losing tokens from the left first (as the draft trainer's ``collate``)."""
    response = example.response_ids[: max_seq_len - 1]
    prompt = example.prompt_ids[-(max_seq_len - len(response)):]
    return prompt + response, len(prompt)


def sequence_key(ids) -> bytes:
    """What a stored sequence is found by: a digest of its token ids."""
    return hashlib.sha1(torch.as_tensor(ids, dtype=torch.int32).numpy().tobytes()).digest()


class FeatureStore:
    """The feature shards of ``directory`` as seen by ``examples``: ``record(i)`` is the i-th
    example's training sequence (``max_seq_len`` tokens at most): ``ids`` [n] int32,
    ``prompt_len``, ``features`` [n, 3d] and ``hidden`` [n, d] (fp16)."""

    def __init__(self, directory: Path, examples: list[Example], max_seq_len: int) -> None:
        self.shards, where = stored_sequences(directory)
        keys = [sequence_key(training_sequence(e, max_seq_len)[0]) for e in examples]
        missing = sum(k not in where for k in keys)
        if missing:
            raise SpecforkError(f"{directory} lacks the features of {missing} of {len(examples)} training "
                                "sequences; run train-draft again to compute them")
        self.index = [where[k] for k in keys]

    def __len__(self) -> int:
        return len(self.index)

    def record(self, index: int) -> dict:
        shard, row = self.index[index]
        return self.shards[shard][row]


def stored_sequences(directory: Path) -> tuple[list[list[dict]], dict[bytes, tuple[int, int]]]:
    """The shards under ``directory`` (memory-mapped) and where each sequence lies in them."""
    shards = [load_shard(p, mmap=True) for p in sorted(directory.glob("shard_*.pt"))]
    where: dict[bytes, tuple[int, int]] = {}
    for s, shard in enumerate(shards):
        for r, record in enumerate(shard):
            where.setdefault(sequence_key(record["ids"]), (s, r))
    return shards, where


def extract_features(llm, examples: list[Example], directory: Path, *, layers: tuple[int, ...], max_seq_len: int,
                     batch: int, shard_size: int, manifest: dict, progress: bool = True) -> FeatureStore:
    """The target's features of every example's training sequence, saved shard by shard under
    ``directory`` (sequences already stored are kept; ``manifest`` must match the one stored
    beside them)."""
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    check_manifest(directory, manifest)
    _, where = stored_sequences(directory)
    todo = list({k: e for e in examples
                 if (k := sequence_key(training_sequence(e, max_seq_len)[0])) not in where}.values())
    logger.info("target features: %d sequences to compute, the other %d of %d already stored under %s",
                len(todo), len(examples) - len(todo), len(examples), directory)
    bar = tqdm(total=len(todo), desc="target features", unit="seq", disable=not progress)
    index = next_shard_index(directory)
    for start in range(0, len(todo), shard_size):
        shard = todo[start : start + shard_size]
        rows = []
        for first in range(0, len(shard), batch):
            rows.extend(_capture(llm, shard[first : first + batch], layers, max_seq_len))
        path = shard_path(directory, index)
        tmp = path.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.replace(path)
        index += 1
        bar.update(len(shard))
    bar.close()
    return FeatureStore(directory, examples, max_seq_len)


def _capture(llm, examples: list[Example], layers: tuple[int, ...], max_seq_len: int) -> list[dict]:
    """One record per example from as few target prefill passes as the KV cache allows."""
    from specfork.engine.sequence import Sequence
    from specfork.sampling_params import SamplingParams

    engine = llm.engine
    pending = [training_sequence(e, max_seq_len) for e in examples]
    rows: list[dict] = []
    while pending:
        seqs = []
        for ids, _ in pending:
            seq = Sequence(-1, ids, SamplingParams(temperature=0.0), torch.Generator())
            if seqs and not engine.block_manager.can_grow(seq, len(ids)):
                break
            engine.block_manager.grow(seq, len(ids))
            seqs.append(seq)
        try:
            hidden, features = _prefill(engine.runner, seqs, layers)
        finally:
            for seq in seqs:
                engine.block_manager.free(seq)
        offset = 0
        for ids, prompt_len in pending[: len(seqs)]:
            n = len(ids)
            rows.append(_record(examples[len(rows)], ids, prompt_len, features[offset : offset + n],
                                hidden[offset : offset + n]))
            offset += n
        pending = pending[len(seqs):]
    return rows


@torch.inference_mode()
def _prefill(runner, seqs, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden [T, d], features [T, 3d]) of the sequences' tokens, flat in their order."""
    tokens = [s.token_ids for s in seqs]
    ids, positions, meta = runner.prepare(seqs, [0] * len(seqs), tokens, decode=False)
    return runner.model(ids, positions, runner.kv_caches, meta, layers)


def _record(example: Example, ids: list[int], prompt_len: int, features: torch.Tensor, hidden: torch.Tensor) -> dict:
    features, hidden = features.to("cpu", STORE_DTYPE), hidden.to("cpu", STORE_DTYPE)
    if not (torch.isfinite(features).all() and torch.isfinite(hidden).all()):
        raise SpecforkError(f"the target's features of example {example.id} overflow {STORE_DTYPE}")
    return {"id": example.id, "ids": torch.tensor(ids, dtype=torch.int32), "prompt_len": prompt_len,
            "features": features.clone(), "hidden": hidden.clone()}
