"""Token sampling, the one module every decoding mode draws through.

``logits_to_probs`` is the one filter (temperature, then top-k, then top-p), so autoregressive
sampling, draft proposals and speculative verification all see the very same distribution for a
request. ``sample`` draws one token per row: argmax for greedy requests, otherwise a draw from the
filtered distribution with the request's own generator; a ``reshape`` hook may replace the
filtered distribution before the draw (SSD's Saguaro sampling), and the distribution actually
drawn from is what is returned, so verification stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specfork.sampling_params import SamplingParams

Reshape = Callable[[torch.Tensor], torch.Tensor]  # [N, V] probabilities -> [N, V] probabilities


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top-k and top-p (greedy rows get temperature 1; callers argmax them)."""
    temp = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    return temp, top_k, top_p


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N] float32, > 0
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float32, 1.0 = off
) -> torch.Tensor:
    """Probabilities [N, V] after temperature scaling, then top-k, then top-p (nucleus).

    Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept).
    Top-p keeps the smallest prefix of tokens, by descending probability, whose mass reaches
    ``top_p`` (at least one token).
    """
    scaled = logits / temperature.unsqueeze(1)
    vocab = scaled.shape[-1]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
            remove |= sorted_logits < kth
        if need_p:
            sorted_probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            remove |= mass_before >= top_p.unsqueeze(1)
            remove[:, 0] = False
        mask = torch.zeros_like(remove).scatter_(1, sorted_idx, remove)
        scaled = scaled.masked_fill(mask, float("-inf"))
    return scaled.softmax(dim=-1)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits_to_probs`` with row i filtered by ``params[i]``."""
    return logits_to_probs(logits, *sampling_tensors(params, logits.device))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` [N, V] (the first one on ties, a NaN counting as the
    largest value, as ``torch.argmax`` does). On the CPU it goes through NumPy, whose argmax is
    vectorised: ~4 us for a 49152-token row where torch's takes ~30 us, paid on every greedy
    step and every verified row."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return np.argmax(logits.numpy(), axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row, row i drawn with ``generators[i]`` (exponential race: argmax p / E)."""
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


@dataclass(slots=True)
class Draw:
    """One token per row; ``probs[j]`` is the distribution row ``sampled[j]`` was drawn from
    (None when every row is greedy)."""

    tokens: list[int]
    sampled: list[int]
    probs: torch.Tensor | None
    _where: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._where = {row: j for j, row in enumerate(self.sampled)}

    def q_of(self, row: int) -> torch.Tensor | None:
        """The distribution ``row`` was drawn from, or None for a greedy row."""
        j = self._where.get(row)
        return None if j is None else self.probs[j]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    reshape: Reshape | None = None,
) -> Draw:
    """One token per row of ``logits`` [N, V]: argmax where ``params[i]`` is greedy, else a draw
    with ``generators[i]`` from the filtered distribution (passed through ``reshape`` first)."""
    tokens = greedy_tokens(logits)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return Draw(tokens, sampled, None)
    idx = torch.tensor(sampled, device=logits.device)
    probs = filtered_probs(logits.index_select(0, idx), [params[i] for i in sampled])
    if reshape is not None:
        probs = reshape(probs)
    for i, token in zip(sampled, sample_from_probs(probs, [generators[i] for i in sampled]).tolist(), strict=True):
        tokens[i] = token
    return Draw(tokens, sampled, probs)
