"""Linear layers. Every projection in the models goes through this one small interface so
that quantized kernels can replace the dense one without touching model code."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseLinear(nn.Module):
    """y = x @ W^T (+ b) with the weight stored as given (fp32 on CPU)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """Build the linear layer for a weight of shape [out_features, in_features]."""
    return DenseLinear(weight, bias)
