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
    ``sources[i]`` names what proposed for sequence i where a proposer combines several (prompt
    lookup first: "lookup" or "draft"; None for a sequence with no budget), for the statistics.
    """

    tokens: list[list[int]]
    probs: torch.Tensor | None  # [B, k, V] float32
    sources: list[str | None] | None = None

    @classmethod
    def of(cls, tokens: list[list[int]], probs: list[torch.Tensor | None], vocab_size: int,
           device: torch.device) -> Proposal:
        """A proposal from per-sequence tokens and the distributions they were drawn from
        (``probs[i]``: [>= len(tokens[i]), >= vocab_size], or None for a greedy request), with q
        on ``device``, the target's."""
        if all(q is None for q in probs):
            return cls(tokens, None)
        k = max((len(t) for t in tokens), default=0)
        if len(tokens) == 1:  # q itself, no copy (a sampled SSD round's q is [k, V], ~1 MB)
            return cls(tokens, probs[0][None, :k, :vocab_size].to(device))
        stacked = torch.zeros(len(tokens), max(k, 1), vocab_size, device=device)
        for i, (t, q) in enumerate(zip(tokens, probs, strict=True)):
            if q is not None and t:
                stacked[i, : len(t)] = q[: len(t), :vocab_size]
        return cls(tokens, stacked)


class Proposer(Protocol):
    feature_layers: tuple[int, ...]
    """Target layers whose inputs the proposer reads (EAGLE-3); empty: it reads none and the
    target captures nothing."""

    def observe_features(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        """The target computed positions ``first_position...`` of ``seq`` (and kept them: a
        prefill chunk, or the accepted positions of a verification); ``features`` [n, len(layers) *
        hidden] are their features."""
        ...

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        """Propose up to ``num_tokens[i]`` tokens after the current tokens of ``seqs[i]``."""
        ...

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        """Verification accepted ``num_accepted`` of the tokens proposed for ``seq`` and appended
        them and one more token (the correction or bonus): drop any draft state past them."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: free everything held for it."""
        ...

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """How many of ``seq``'s first ``num_tokens`` tokens (whole KV blocks the target's prefix
        cache holds) it may take without the target computing them again: a proposer that reads
        the target's features needs its own state for them cached too."""
        ...

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """``seq`` took its first ``num_tokens`` tokens from the target's cache (at most what
        ``usable_prefix`` allowed): the target's features start after them."""
        ...


class ReadsNoFeatures:
    """A proposer that does not read the target's features (what it keeps per sequence, if
    anything, it builds from the tokens, so a prompt's cached prefix changes nothing for it)."""

    feature_layers: tuple[int, ...] = ()

    def observe_features(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        pass

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        return num_tokens

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        pass


class StatelessProposer(ReadsNoFeatures):
    """A proposer that keeps nothing per sequence (n-gram lookup, no proposals at all)."""

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class NoProposals(StatelessProposer):
    """Propose nothing: plain AR through the speculative step (the last-resort fallback)."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        return Proposal([[] for _ in seqs], None)
