"""Block-quantised weights and the linear layer that runs them without dequantising per step.

A :class:`QuantizedWeight` holds a weight [N, K] as GGUF does: integer values q, and per group of
``group`` inputs of each row a scale d and an offset o, with w = q * d + o. GGUF's formats map onto
it without re-quantisation (:mod:`specfork.layers.gguf_blocks`), and ``quantize_int4`` makes the
same form from float weights (HF checkpoints, ``--quantize int4``).

It supports what model construction does with weights: ``torch.cat`` along rows (fused q/k/v and
gate/up projections), row selection (llama.cpp's q/k row order), ``.to(device)``. On CPU in
float32 :class:`QuantizedLinear` runs the native kernel (``csrc/quant_gemm.cpp``); elsewhere, or
without a compiler, the weight is dequantised once and the dense layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from specfork.native_kernels import kernels as native_kernels

Q4, Q5, Q6, Q8 = 4, 5, 6, 8
IQ4 = 12  # the kernel's format of 8-bit values that are all IQ4_VALUES: packed as their 4-bit indices
# IQ4_NL's and IQ4_XS's 16 values, which their 4-bit indices select (ggml's kvalues_iq4nl; the
# kernel's kIQ4Values).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_NOT_IQ4 = 255
# Each int8 value's index in IQ4_VALUES (by its byte, as uint8), _NOT_IQ4 for the other values.
_IQ4_INDEX = torch.full((256,), _NOT_IQ4, dtype=torch.uint8)
_IQ4_INDEX[torch.tensor(IQ4_VALUES, dtype=torch.int8).view(torch.uint8).long()] = torch.arange(16, dtype=torch.uint8)
INPUT_BITS = (16, 8)  # how finely the native kernel rounds activations (csrc/quant_gemm.cpp)
INT8_INPUTS = 16  # the kernel's format flag for int8 activations
MAX_GROUP = 128  # the native kernel's limit (csrc/quant_gemm.cpp, kMaxGroup)
MAX_GROUP_OF_BITS = {5: 64, 6: 32}  # and its limits for 5- and 6-bit values (max_group there: their int32 sums)


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # [N, K] uint8 (Q4: 0..15, Q5: 0..31, Q6: 0..63) or int8 (Q8)
    scale: torch.Tensor  # [N, K / group] float32 holding fp16 values (GGUF's; quantize_int4 rounds to them)
    offset: torch.Tensor  # [N, K / group] float32 holding fp16 values
    bits: int  # 4, 5, 6 or 8
    source: str  # the GGUF format in lower case ("q4_1", "q4_k", ...; "+"-joined when fused) or "int4" (at load)
    input_bits: int = 16  # the native kernel rounds each group of activations to int16, or int8 (INPUT_BITS)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        d = self.scale.repeat_interleave(self.group, dim=1)
        o = self.offset.repeat_interleave(self.group, dim=1)
        return torch.addcmul(o, self.q.to(torch.float32), d)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        return replace(self, q=self.q[index], scale=self.scale[index], offset=self.offset[index])

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Inputs ``start..stop``, both on group boundaries (a tensor-parallel row split)."""
        g = self.group
        if start % g or stop % g:
            raise ValueError(f"inputs {start}..{stop} cut a quantisation group of {g} inputs")
        return replace(self, q=self.q[:, start:stop].contiguous(), scale=self.scale[:, start // g : stop // g].contiguous(),
                       offset=self.offset[:, start // g : stop // g].contiguous())

    def to(self, device=None, dtype=None) -> QuantizedWeight | torch.Tensor:
        """Stays quantised on CPU in float32 (the native path); anything else gets dense weights."""
        device = torch.device(device) if device is not None else self.q.device
        if device.type != "cpu" or (dtype is not None and dtype != torch.float32):
            return self.dequantize().to(device=device, dtype=dtype)
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat:
            parts = list(args[0])
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if dim == 0 and all(isinstance(p, QuantizedWeight) for p in parts):
                common = _common_form(parts)
                if common is not None:
                    parts = common
                    return QuantizedWeight(
                        torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                        torch.cat([p.offset for p in parts]), parts[0].bits, "+".join(sorted({p.source for p in parts})),
                        parts[0].input_bits,
                    )
            dense = [p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]
            return torch.cat(dense, dim=dim)
        args = tuple(a.dequantize() if isinstance(a, QuantizedWeight) else a for a in args)
        return func(*args, **kwargs)


def dense(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


def _common_form(parts: list[QuantizedWeight]) -> list[QuantizedWeight] | None:
    """The same weights in one form, exactly: the most bits any part has (4-bit q 0..15 are 5-, 6-
    and 8-bit values too, and so on, with the same d and o) and the smallest group (a group's d and
    o repeated over its smaller groups), so that a fused projection of differently quantised parts
    (a GGUF Q4_K_M file's Q4_K query and key with a Q6_K value) stays quantised rather than turning
    dense. The narrower parts then cost the wider form's bytes, and their activations' rounding
    error is multiplied by |q - c| with the wider form's centre c (docs/decisions.md, 2026-11-30).
    None where no such form exists (activations rounded differently, groups that do not divide)."""
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    if len({p.input_bits for p in parts}) > 1 or any(p.group % group for p in parts):
        return None
    out = []
    for p in parts:
        if p.bits != bits:
            p = replace(p, q=p.q.to(torch.int8) if bits == Q8 else p.q, bits=bits)
        if p.group != group:
            repeat = p.group // group
            p = replace(p, scale=p.scale.repeat_interleave(repeat, dim=1), offset=p.offset.repeat_interleave(repeat, dim=1))
        out.append(p)
    return out


def quantize_int4(weight: torch.Tensor, group: int) -> QuantizedWeight:
    """Asymmetric 4-bit quantisation per group of inputs: q = round((w - min) / d), d = (max - min) / 15,
    with d and min rounded to fp16 first (as GGUF's Q4_1 stores them; the native kernel reads them so)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"cannot quantise a weight with {k} inputs in groups of {group}")
    w = weight.detach().to(torch.float32).reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15.0).to(torch.float16).to(torch.float32)
    lo = lo.to(torch.float16).to(torch.float32)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.clamp(torch.round((w - lo[..., None]) / safe[..., None]), 0, 15).to(torch.uint8).reshape(n, k)
    return QuantizedWeight(q, d.contiguous(), lo.contiguous(), Q4, "int4")


# ---- the layer -----------------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ b) with W block-quantised, on the native kernel. Each row is computed
    independently of the others (batch-invariant by construction)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, kernels) -> None:
        super().__init__()
        self._kernels = kernels
        self.source = weight.source
        self.bits = weight.bits
        self.input_bits = weight.input_bits
        q, packed = _packed_values(weight)
        self.format = packed | (INT8_INPUTS if weight.input_bits == 8 else 0)  # the kernel's format code
        self.out_features, self.in_features = weight.shape
        values, scales, offsets = kernels.pack_quantized(q, weight.scale, weight.offset, self.format)
        self.weight_bytes = values.nbytes + scales.nbytes + offsets.nbytes  # what one pass reads
        self.values = nn.Parameter(values, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.offsets = nn.Parameter(offsets, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernels.quant_linear(x, self.values, self.scales, self.offsets, self.out_features, self.format,
                                          self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.source}, int{self.input_bits} inputs"


def _packed_values(weight: QuantizedWeight) -> tuple[torch.Tensor, int]:
    """The values the kernel packs and their format: 8-bit values that are all IQ4's table values
    (an IQ4_NL or IQ4_XS matrix, or a fused projection of them) go as their 4-bit indices, half the
    bytes, which the kernel looks up as it unpacks them (the same values, so the same sums)."""
    if weight.bits != Q8 or not weight.q.numel():
        return weight.q, weight.bits
    rows = max(1, (1 << 20) // weight.q.shape[1])  # a million values at a time: a few MB held, whatever the weight
    indices = []
    for chunk in weight.q.split(rows):
        looked_up = _IQ4_INDEX[chunk.view(torch.uint8).long()]
        if bool((looked_up == _NOT_IQ4).any()):  # not IQ4's values (the first rows of a Q8_0 matrix tell)
            return weight.q, weight.bits
        indices.append(looked_up)
    return torch.cat(indices), IQ4


def quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None) -> nn.Module | None:
    """The native quantised layer, or None where it cannot run (no compiler, odd shapes)."""
    kernels = native_kernels()
    if kernels is None or weight.q.device.type != "cpu":
        return None
    if bias is not None and bias.dtype != torch.float32:
        return None
    if weight.group % 2 or weight.group > MAX_GROUP_OF_BITS.get(weight.bits, MAX_GROUP):
        return None
    if weight.input_bits == 8 and weight.group % 4:  # int8 inputs go by quads; this layer keeps int16
        weight = replace(weight, input_bits=16)
    return QuantizedLinear(weight, bias, kernels)
