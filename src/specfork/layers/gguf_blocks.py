"""GGUF's block-quantised formats unpacked into :class:`QuantizedWeight` (integer q, per-group scale
d and offset o, w = q * d + o), the form the native kernel runs.

Every format GGUF's Llama files commonly use maps onto it:

* ``Q4_0``, ``Q4_1``, ``Q8_0`` (blocks of 32, one fp16 d and m): exactly, 4- or 8-bit q.
* ``Q5_0``, ``Q5_1``: exactly, 5-bit q in groups of 32 (Q5_0's o = -16 d).
* k-quants (super-blocks of 256 with sub-block scales): ``Q4_K`` as 4-bit q in groups of 32 with
  d = d_super * sc and o = -dmin * m; ``Q5_K`` the same with 5-bit q; ``Q6_K`` as 6-bit q in groups
  of 16 with d = d_super * sc and o = -32 d; ``Q3_K`` (3-bit) and ``Q2_K`` (2-bit) as 4-bit q in
  groups of 16 (d = d_super * (sc - 32), o = -4 d; d = d_super * sc, o = -dmin * m).
* ``IQ4_NL`` and ``IQ4_XS`` (4-bit indices into a table of 16 int8 values, blocks of 32 / super-
  blocks of 256 with 6-bit sub-block scales): as 8-bit q, the table's values, in groups of 32 with
  d = d_block (exactly) or d = d_super * (ls - 32). The kernel packs such values as their 4-bit
  indices again (layers/quantized.py) and looks them up as it unpacks them.

The kernel stores each group's d and o in fp16 as GGUF does for the simple formats, so the
k-quants' and IQ4_XS's products of an fp16 and a 4- to 8-bit integer are rounded to fp16: each weight moves by
at most 2^-11 of its group's |d q| + |o|, against a quantisation step of d. :func:`decode_blocks`
gives the exact float32 d and o for tests and measurements.

The other formats (the smaller i-quants, whose groups of values index a lattice codebook) are
dequantised to float32 by the loader.
"""

from __future__ import annotations

import numpy as np
import torch

from specfork.layers.quantized import IQ4_VALUES, Q4, Q5, Q6, Q8, QuantizedWeight

# Bytes per block and values per block of each format unpacked here.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210, "IQ4_NL": 18, "IQ4_XS": 136}
BLOCK_VALUES = {name: (256 if name.endswith("_K") or name == "IQ4_XS" else 32) for name in BLOCK_BYTES}
NATIVE_FORMATS = tuple(BLOCK_BYTES)


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight | None:
    """A GGUF tensor's rows (``raw``: its bytes, [N, row_bytes] uint8) as a :class:`QuantizedWeight`,
    scales and offsets rounded to fp16 values (exact for every format but the k-quants and IQ4_XS);
    None where a combined scale is beyond fp16's range (the tensor is then better dequantised)."""
    q, d, o, bits = decode_blocks(raw, type_name, shape)
    with np.errstate(over="ignore"):
        d16, o16 = _fp16(d), _fp16(o)
    if not (np.isfinite(d16) | ~np.isfinite(d)).all() or not (np.isfinite(o16) | ~np.isfinite(o)).all():
        return None
    return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(d16), torch.from_numpy(o16), bits, type_name.lower())


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]):
    """(q [N, K] uint8 for 4-, 5- and 6-bit / int8 for 8-bit, d [N, K / G] float32, o [N, K / G] float32, bits):
    w = q * d + o exactly as GGUF's dequantiser computes it."""
    if type_name not in BLOCK_BYTES:
        raise ValueError(f"no native form for GGUF {type_name} (native: {', '.join(NATIVE_FORMATS)})")
    n, k = shape
    per_block = BLOCK_VALUES[type_name]
    if k % per_block:
        raise ValueError(f"{type_name}: {k} inputs per row is not a multiple of its block of {per_block}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per_block, BLOCK_BYTES[type_name])
    q, d, o, bits = _DECODERS[type_name](blocks)
    return (np.ascontiguousarray(q.reshape(n, k)), np.ascontiguousarray(d.reshape(n, -1), dtype=np.float32),
            np.ascontiguousarray(o.reshape(n, -1), dtype=np.float32), bits)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of every block, as float32 [N, blocks]."""
    return blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 16] -> [..., 32]: the low nibbles (values 0..15), then the high nibbles (16..31)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _q4_0(blocks):
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 2:]), d, -8.0 * d, Q4


def _q4_1(blocks):
    return _nibbles(blocks[..., 4:]), _half(blocks, 0), _half(blocks, 2), Q4


def _q8_0(blocks):
    return blocks[..., 2:].copy().view(np.int8), _half(blocks, 0), np.zeros(blocks.shape[:-1], np.float32), Q8


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes of high bits [..., 4] -> bit j of the little-endian word, shifted to 16, [..., 32]."""
    word = qh.copy().view("<u4")[..., 0].astype(np.uint32)
    bits = (word[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return (bits << 4).astype(np.uint8)


def _q5_0(blocks):
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 6:]) | _fifth_bits(blocks[..., 2:6]), d, -16.0 * d, Q5


def _q5_1(blocks):
    return _nibbles(blocks[..., 8:]) | _fifth_bits(blocks[..., 4:8]), _half(blocks, 0), _half(blocks, 2), Q5


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> the eight 6-bit sub-block scales and minima [..., 8]:
    sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and 4..7 (minima); sub-blocks 4..7
    take their low 4 bits from bytes 8..11 (scale: low nibble, minimum: high nibble) and their top
    2 bits from the top bits of bytes 0..3 (scales) and 4..7 (minima)."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (high & 15) | ((low >> 6) << 4)], axis=-1)
    minima = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), minima.astype(np.float32)


def _k_groups(blocks, sub_scales, sub_minima):
    """Per 32-value sub-block: d = d_super * sc, o = -dmin * m."""
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    return d[..., None] * sub_scales, -(dmin[..., None] * sub_minima)


def _q4_k(blocks):
    sc, m = _k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)  # per 64 values: 32 low nibbles, then 32 high
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [..., 4, 64]: sub-blocks 2j, 2j + 1
    d, o = _k_groups(blocks, sc, m)
    return q.reshape(*blocks.shape[:-1], 256), d, o, Q4


def _q5_k(blocks):
    sc, m = _k_scales(blocks[..., 4:16])
    qh = blocks[..., 16:48]  # [..., 32]: bit 2j of byte l is value l of sub-block 2j's fifth bit, 2j + 1 likewise
    qs = blocks[..., 48:].reshape(*blocks.shape[:-1], 4, 32)
    shift = np.arange(8, dtype=np.uint8)
    high = ((qh[..., None, :] >> shift[:, None]) & 1) << 4  # [..., 8 sub-blocks, 32]
    low = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*blocks.shape[:-1], 8, 32)
    d, o = _k_groups(blocks, sc, m)
    return (low | high).reshape(*blocks.shape[:-1], 256), d, o, Q5


def _q6_k(blocks):
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 2, 32)  # per half of 128 values: two runs of 32 bytes
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 32)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # 16 scales, one per 16 values
    d = _half(blocks, 208)
    # Within a half: values 0..31 low nibbles of run 0 (high bits 0-1 of qh), 32..63 low nibbles of
    # run 1 (bits 2-3), 64..95 high nibbles of run 0 (bits 4-5), 96..127 high nibbles of run 1 (bits 6-7).
    low = np.stack([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-2)
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-2)
    d_groups = d[..., None] * sc
    return (low | (high << 4)).reshape(*blocks.shape[:-1], 256), d_groups, -32.0 * d_groups, Q6


def _two_bit_runs(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 64 bytes of 2-bit values [..., 64] -> [..., 256]: per half of 128 values, four
    runs of 32 (bits 0-1, 2-3, 4-5, 6-7 of the half's 32 bytes)."""
    halves = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    runs = (halves >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [..., 2, 4, 32]
    return runs.reshape(*qs.shape[:-1], 256)


def _q2_k(blocks):
    packed = blocks[..., 0:16]  # per 16 values: scale (low nibble) and minimum (high nibble)
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    scales, minima = (packed & 15).astype(np.float32), (packed >> 4).astype(np.float32)
    return _two_bit_runs(blocks[..., 16:80]), d[..., None] * scales, -(dmin[..., None] * minima), Q4


def _q3_k(blocks):
    hmask, packed = blocks[..., 0:32], blocks[..., 96:108]
    # 16 scales of 6 bits: low nibbles in bytes 0..7 (scales 0..7, then 8..15 in the high nibbles),
    # top 2 bits in bytes 8..11 (scale 4 s + b: bits 2 s, 2 s + 1 of byte 8 + b)
    low = np.concatenate([packed[..., 0:8] & 15, packed[..., 0:8] >> 4], axis=-1)
    high = (packed[..., 8:12][..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    scales = (low | (high.reshape(*packed.shape[:-1], 16) << 4)).astype(np.float32) - 32.0
    # value i of a run of 32 (8 runs): bit (i // 32) of hmask[i % 32] set means q, clear q - 4
    bit = (hmask[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [..., 8, 32]
    q = _two_bit_runs(blocks[..., 32:96]) | (bit.reshape(*blocks.shape[:-1], 256) << 2)
    d_groups = _half(blocks, 108)[..., None] * scales
    return q, d_groups, -4.0 * d_groups, Q4


_IQ4_VALUES = np.array(IQ4_VALUES, dtype=np.int8)


def _iq4_nl(blocks):
    # Q4_0's layout (fp16 d, then 16 bytes: values 0..15 in the low nibbles, 16..31 in the high)
    return _IQ4_VALUES[_nibbles(blocks[..., 2:])], _half(blocks, 0), np.zeros(blocks.shape[:-1], np.float32), Q8


def _iq4_xs(blocks):
    # fp16 d, a 16-bit word of the sub-block scales' top 2 bits (bits 2 j, 2 j + 1), 4 bytes of their
    # low 4 bits (sub-block j: nibble j % 2 of byte j // 2), then per sub-block 16 bytes as IQ4_NL's
    high = blocks[..., 2:4].copy().view("<u2")[..., 0].astype(np.uint16)
    low = np.stack([blocks[..., 4:8] & 15, blocks[..., 4:8] >> 4], axis=-1).reshape(*blocks.shape[:-1], 8)
    top = (high[..., None] >> (2 * np.arange(8, dtype=np.uint16))) & 3
    scales = (low | (top << 4)).astype(np.float32) - 32.0
    qs = blocks[..., 8:].reshape(*blocks.shape[:-1], 8, 16)
    q = _IQ4_VALUES[_nibbles(qs)].reshape(*blocks.shape[:-1], 256)
    d = _half(blocks, 0)[..., None] * scales
    return q, d, np.zeros(d.shape, np.float32), Q8


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k, "Q3_K": _q3_k,
             "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
