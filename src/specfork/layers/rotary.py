"""Rotary position embeddings (HF "rotate_half" layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2]; ``scaling`` follows HF's ``rope_scaling`` dict."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # GGUF rope_freqs: one divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, expected {inv_freq.numel()}")
        return inv_freq / factors
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        half = emb.shape[-1] // 2
        # rotate_half(x) * sin == roll(x, half) * cat(-sin[:half], sin[half:]) element for element
        self.register_buffer("sin_signed", torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), dim=-1),
                             persistent=False)

    def at(self, positions: torch.Tensor) -> RopeTables:
        """The rotation of these positions, shared by every layer of a forward."""
        return RopeTables(self.cos, self.sin_signed, positions)


class RopeTables:
    """The rotation of some positions: ``cos`` and ``sin_signed`` [T, 1, D], gathered on first
    use. A native forward reads the whole tables (``table_cos``, ``table_sin_signed``) at the
    positions itself, so it never gathers: after a forward has flushed the caches, the two
    gathers cost ~35 us of Python per forward."""

    def __init__(self, table_cos: torch.Tensor, table_sin_signed: torch.Tensor, positions: torch.Tensor) -> None:
        self.table_cos, self.table_sin_signed, self.positions = table_cos, table_sin_signed, positions
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cos(self) -> torch.Tensor:
        return self._gather()[0]

    @property
    def sin_signed(self) -> torch.Tensor:
        return self._gather()[1]

    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gathered is None:
            self._gathered = (self.table_cos[self.positions].unsqueeze(1),
                              self.table_sin_signed[self.positions].unsqueeze(1))
        return self._gathered

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated (HF's rotate_half layout)."""
        cos, sin = self.cos.to(x.dtype), self.sin_signed.to(x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
