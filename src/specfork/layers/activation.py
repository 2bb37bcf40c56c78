"""SwiGLU's gating: silu(gate) * up of a fused gate_up projection's output.

On CPU float32 rows the native kernel computes it (``csrc/activation.cpp``): the same arithmetic
the one-call native forward uses, so the module path and that forward agree bit for bit; anywhere
else PyTorch's ``F.silu(gate) * up``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specfork.native_kernels import kernels as native_kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 I] holding gate and up side by side -> silu(gate) * up, [..., I]."""
    if gate_up.device.type == "cpu" and gate_up.dtype == torch.float32 and not gate_up.requires_grad:
        kernels = native_kernels()
        if kernels is not None:
            return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
