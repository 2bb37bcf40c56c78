"""Linear layers. Every projection in the models goes through this one small interface so
that quantized kernels can replace the dense one without touching model code."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specfork.layers.quantized import QuantizedWeight, quantized_linear
from specfork.native_kernels import kernels as native_kernels

# Without the native kernel, BLAS picks another kernel (and summation order) for very few rows;
# batch-invariant mode pads to at least this many rows so every row is computed the same way.
BATCH_INVARIANT_MIN_ROWS = 8


class DenseLinear(nn.Module):
    """y = x @ W^T (+ b).

    On CPU in float32 the weight is packed for the native kernel (``csrc/small_m_gemm.cpp``),
    which streams the weights once per 8 rows and computes each row independently of the
    others; measured here it beats MKL's GEMM from 1 to 256 rows (2.5-4x for the 1-8 rows of
    decode and verification). Elsewhere (CUDA, or no compiler) ``weight`` [out, in] serves
    BLAS, and on CPU a row-major copy W^T serves one or two rows (a faster GEMV than BLAS on W
    here). Only one layout is read per call.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.batch_invariant = False
        self.packed = self.weight_t = None
        self._kernels = None
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            self._kernels = native_kernels()
            if self._kernels is not None:
                self.packed = nn.Parameter(self._kernels.pack_weight(weight), requires_grad=False)
            else:
                self.weight_t = nn.Parameter(weight.t().contiguous(), requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed is not None:  # batch-invariant by construction
            return self._kernels.small_m_linear(x, self.packed, self.out_features, self.bias)
        if self.batch_invariant and rows < BATCH_INVARIANT_MIN_ROWS:
            padded = torch.cat([x, x.new_zeros(BATCH_INVARIANT_MIN_ROWS - rows, x.shape[1])])
            return F.linear(padded, self.weight, self.bias)[:rows]
        if self.weight_t is not None and rows <= 2:
            y = x @ self.weight_t
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def make_linear(weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> nn.Module:
    """Build the linear layer for a weight of shape [out_features, in_features]: the native
    quantised layer for a block-quantised weight where it can run, the dense one otherwise."""
    if isinstance(weight, QuantizedWeight):
        layer = quantized_linear(weight, bias)
        return layer if layer is not None else DenseLinear(weight.dequantize(), bias)
    return DenseLinear(weight, bias)


def set_batch_invariant(module: nn.Module, enabled: bool) -> None:
    """Make every linear layer under ``module`` compute each row independently of the others."""
    for m in module.modules():
        if isinstance(m, DenseLinear):
            m.batch_invariant = enabled
