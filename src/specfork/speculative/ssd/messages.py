"""What the target and the SSD drafter process say to each other: the launch, per-round
requests and replies (see ``worker.py`` for the message order)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specfork.sampling_params import SamplingParams
from specfork.speculative.draft_loading import DraftSpec


@dataclass(frozen=True, slots=True)
class DrafterSettings:
    k: int
    fanout_hit: tuple[int, ...]
    fanout_miss: tuple[int, ...]
    backup: str = "jit"
    tree_backend: str = "fast"
    saguaro: float | None = None
    block_size: int = 16
    num_blocks: int = 4096
    vocab_size: int = 0  # the target's (draft rows beyond it are never proposed)


@dataclass(frozen=True, slots=True)
class DrafterLaunch:
    draft: DraftSpec
    settings: DrafterSettings
    device: str
    threads: int
    cores: tuple[int, ...] | None
    seed: int


@dataclass(slots=True)
class SpecRequest:
    """One sequence's part of a speculation request.

    ``new_tokens``: tokens committed since this sequence's previous request, the new ``rec``
    last (the whole prompt plus the first sampled token on the first request).
    ``num_accepted``: n of the previous verification (None on the first request).
    ``features``: for a drafter that reads the target's features (an EAGLE-3 head), the
    target's features of positions ``features_from...`` computed since the previous request
    (the prompt's, then the accepted positions of each verification) [n, layers * hidden].
    """

    seq_id: int
    new_tokens: list[int]
    num_accepted: int | None
    params: SamplingParams
    num_tokens: int
    features: np.ndarray | None = None
    features_from: int = 0


@dataclass(slots=True)
class SpecReply:
    seq_id: int
    source: str  # "hit", "jit" or "fast"
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] q of each token; None for greedy requests


@dataclass(slots=True)
class WireReply:
    """A reply as it crosses the pipe (numpy arrays pickle without shared-memory handles)."""

    seq_id: int
    source: str
    tokens: list[int]
    probs: np.ndarray | None

    @classmethod
    def of(cls, reply: SpecReply) -> WireReply:
        probs = None if reply.probs is None else reply.probs.detach().float().cpu().numpy()
        return cls(reply.seq_id, reply.source, reply.tokens, probs)
