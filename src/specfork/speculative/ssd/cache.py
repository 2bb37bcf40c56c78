"""The speculation cache: the drafts pre-drafted for the next round, keyed by the verification
outcome they are for, (sequence, drafts accepted j, the token the target sampled after them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from specfork.speculative.ssd.messages import SpecRequest


@dataclass(slots=True)
class CachedDraft:
    tokens: list[int]
    probs: torch.Tensor | None  # q of each token over the drafter's columns (an EAGLE-3 head's: its draft
    # vocabulary; the drafter scatters a hit's into the target's); None for greedy requests


class SpeculationCache:
    """Holds exactly the entries for the round about to be asked for."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int, int], CachedDraft] = {}

    def put(self, seq_id: int, j: int, rec: int, draft: CachedDraft) -> None:
        self._entries[(seq_id, j, rec)] = draft

    def lookup(self, req: SpecRequest, last_spec: list[int]) -> CachedDraft | None:
        """The entry for the outcome ``req`` reports, if that outcome is the one speculated: the
        accepted tokens must be the first n of ``last_spec`` (the speculation the sequence was
        last given), else the entries are for another context."""
        n = req.num_accepted
        if n is None or len(req.new_tokens) != n + 1 or req.new_tokens[:n] != last_spec[:n]:
            return None
        return self._entries.get((req.seq_id, n, req.new_tokens[-1]))

    def clear(self) -> None:
        self._entries.clear()

    def release(self, seq_id: int) -> None:
        for key in [key for key in self._entries if key[0] == seq_id]:
            del self._entries[key]

    @property
    def entries(self) -> Mapping[tuple[int, int, int], CachedDraft]:
        """A read-only view, keyed (sequence, j, candidate)."""
        return MappingProxyType(self._entries)
