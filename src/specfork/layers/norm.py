"""RMSNorm as Llama/Qwen define it (statistics in fp32, scaled by a learned weight)."""

from __future__ import annotations

import torch
from torch import nn

from specfork.native_kernels import kernels as native_kernels


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self._kernel = native_kernels() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return self._kernel.rms_norm(x, self.weight, self.eps)  # csrc/rms_norm.cpp: one pass per row
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
