"""Token sampling. ``logits_to_probs`` is the one filter (temperature, top-k, top-p) that every
decoding mode uses, so autoregressive sampling and speculative verification see the very same
distribution."""

from __future__ import annotations

import torch


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


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, row i drawn with ``generators[i]`` (exponential race: argmax p / E)."""
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)
