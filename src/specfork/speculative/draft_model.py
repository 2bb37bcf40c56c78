"""Draft-model proposer: a smaller checkpoint with the target's vocabulary, its own paged KV
cache, drafting k tokens autoregressively with each request's own sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfork.engine.block_manager import BlockManager
from specfork.engine.model_runner import ModelRunner
from specfork.engine.sequence import Sequence
from specfork.engine.step import sample_with_probs
from specfork.errors import ModelLoadError
from specfork.loading import LoadedModel
from specfork.speculative.proposer import Proposal


@dataclass
class DraftState:
    """The draft's KV cache of one sequence: its blocks and how many leading tokens they hold."""

    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


def check_vocabularies(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft that does not map the target's token ids to the same tokens. A draft whose
    embedding is padded beyond the target's vocabulary is fine (extra ids are never proposed)."""
    tv, dv = target.arch.vocab_size, draft.arch.vocab_size
    if dv < tv:
        raise ModelLoadError(f"draft vocabulary ({dv} tokens) is smaller than the target's ({tv})")
    if target.tokenizer is not None and draft.tokenizer is not None:
        t_vocab = target.tokenizer.vocab
        d_vocab = draft.tokenizer.vocab
        mismatched = [tok for tok, i in t_vocab.items() if i < tv and d_vocab.get(tok) != i]
        if mismatched:
            raise ModelLoadError(
                f"draft and target tokenizers differ ({len(mismatched)} tokens map to other ids, e.g. "
                f"{mismatched[:3]}); a draft must share the target's vocabulary"
            )


class DraftModelProposer:
    def __init__(self, draft: LoadedModel, *, vocab_size: int, num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        self.runner = ModelRunner(draft.model, num_blocks=num_blocks, block_size=block_size, device=device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.vocab_size = vocab_size
        self.device = device
        self._states: dict[int, DraftState] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        k = max(num_tokens, default=0)
        tokens: list[list[int]] = [[] for _ in seqs]
        probs = None
        if any(not s.params.greedy for s in seqs):
            probs = torch.zeros(len(seqs), max(k, 1), self.vocab_size, device=self.device)
        active = [i for i, n in enumerate(num_tokens) if n > 0]
        states = {i: self._state(seqs[i]) for i in active}
        for i in active:
            self.blocks.grow(states[i], len(seqs[i]) + num_tokens[i] - 1)
        step = 0
        while active:
            rows = [seqs[i] for i in active]
            feeds = []
            for i in active:
                st = states[i]
                known = seqs[i].token_ids + tokens[i]
                feeds.append(known[st.num_cached_tokens :])
            starts = [states[i].num_cached_tokens for i in active]
            last_rows, offset = [], 0
            for f in feeds:
                offset += len(f)
                last_rows.append(offset - 1)
            logits = self.runner.forward([states[i] for i in active], starts, feeds, last_rows, decode=True)
            logits = logits[:, : self.vocab_size]
            for i, f in zip(active, feeds, strict=True):
                states[i].num_cached_tokens += len(f)
            drafted = self._sample(logits, rows, probs, active, step)
            for i, t in zip(active, drafted, strict=True):
                tokens[i].append(t)
            step += 1
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
        return Proposal(tokens, probs)

    def _sample(self, logits, seqs, probs, rows, step) -> list[int]:
        """Draft tokens for ``seqs``; the distributions q they were drawn from go into
        ``probs[rows[j], step]``."""
        tokens, sampled, q = sample_with_probs(logits, seqs)
        for j, row in zip(sampled, q if q is not None else [], strict=True):
            probs[rows[j], step] = row
        return tokens

    def _state(self, seq: Sequence) -> DraftState:
        st = self._states.get(seq.seq_id)
        if st is None:
            st = self._states[seq.seq_id] = DraftState()
        return st

    def accepted(self, seq: Sequence) -> None:
        st = self._states.get(seq.seq_id)
        if st is not None:
            # Draft KV is valid only for the prefix shared with the sequence's committed tokens.
            st.num_cached_tokens = min(st.num_cached_tokens, len(seq) - 1)

    def release(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self.blocks.free(st)
