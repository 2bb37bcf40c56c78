"""The contract between proposers (drafters) and the verifier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specfork.engine.sequence import Sequence


@dataclass(slots=True)
class Proposal:
    """Proposed continuations for a batch of sequences.

    tokens[i] holds at most k tokens for sequence i (possibly none). ``probs[i, j]`` is the
    distribution q that ``tokens[i][j]`` was drawn from, after the request's own
    temperature/top-k/top-p; rows of greedy requests and positions past ``len(tokens[i])`` are
    unused. ``probs is None`` means every proposal is deterministic (verified as one-hot q).
    """

    tokens: list[list[int]]
    probs: torch.Tensor | None  # [B, k, V] float32


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        """Propose up to ``num_tokens[i]`` tokens after the current tokens of ``seqs[i]``."""
        ...

    def accepted(self, seq: Sequence) -> None:
        """Called after verification appended tokens to ``seq``: drop any draft state past them."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: free everything held for it."""
        ...
