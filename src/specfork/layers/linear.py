"""Linear layers. Every projection in the models goes through this one small interface so
that quantized kernels can replace the dense one without touching model code."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DenseLinear(nn.Module):
    """y = x @ W^T (+ b).

    The weight is kept in two layouts: ``weight`` [out, in] for BLAS GEMM with several rows,
    and ``weight_t`` [in, out] for one or two rows, where a row-major x @ W^T streams the
    weights measurably faster on CPU (see docs/decisions.md). Only one of them is read per call.
    """

    SMALL_ROWS = 2

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # Batch-invariant mode: BLAS picks another kernel (and summation order) for very few
        # rows, so pad to at least this many rows; every row is then computed the same way.
        self.min_rows = 1

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self.SMALL_ROWS and self.min_rows == 1:
            y = x @ self.weight_t
            return y if self.bias is None else y + self.bias
        if rows >= self.min_rows:
            return F.linear(x, self.weight, self.bias)
        padded = torch.cat([x, x.new_zeros(self.min_rows - rows, x.shape[1])])
        return F.linear(padded, self.weight, self.bias)[:rows]


BATCH_INVARIANT_MIN_ROWS = 8


def set_batch_invariant(module: nn.Module, enabled: bool) -> None:
    """Switch every linear layer under ``module`` to (or from) batch-invariant row padding."""
    for m in module.modules():
        if isinstance(m, DenseLinear):
            m.min_rows = BATCH_INVARIANT_MIN_ROWS if enabled else 1


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """Build the linear layer for a weight of shape [out_features, in_features]."""
    return DenseLinear(weight, bias)
