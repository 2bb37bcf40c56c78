"""Attention over a paged KV cache.

The cache of one layer is a tensor ``[2, num_blocks, num_kv_heads, block_size, head_dim]``
(keys, then values; ``new_kv_cache``), in the model's dtype or float16 (``--kv-cache-dtype``: keys
and values are rounded to it when written and read back exactly as float32). A sequence owns a
list of blocks (its block table); token ``i`` of the sequence lives in block
``block_table[i // block_size]`` at offset ``i % block_size``. Within a block each KV head's keys
(and values) are contiguous, so attention reads a head's keys as a few streams, not rows strided
by the other heads (docs/decisions.md).

The native CPU kernel (``csrc/paged_attention.cpp``) serves decode and verification steps and
prefill passes (a long pass in several calls over its rows, ``ModelRunner``): it reads keys and
values through the block table without copying and is batch-invariant by construction, so a
prompt prefilled in one pass gives what it gives fed token by token. The reference backend
gathers each sequence's blocks and runs
``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask, so causal
prefill, decode, multi-token verification windows and tree masks are all the same code path:
the caller states which keys each query may see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specfork.native_kernels import kernels as native_kernels


@dataclass(slots=True)
class AttentionMetadata:
    """Where new keys/values go and what each query may attend to, for one forward pass.

    The flat batch of T new tokens is laid out sequence after sequence. For attention the
    queries are viewed as a padded ``[B, q_max]`` grid.
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64 (unused entries 0)
    k_max: int  # keys gathered per sequence (the longest context in the batch)
    mask: torch.Tensor | None  # [B, 1, q_max, k_max] bool, True = may attend; None = attend to all k_max
    q_max: int  # longest query run in the batch
    pad_index: torch.Tensor | None  # [B * q_max] int64 into the flat T tokens; None if no padding
    unpad_index: torch.Tensor | None  # [T] int64 into the padded B * q_max grid
    batch_invariant: bool = False  # use paged_attention_invariant (bit-identical whatever the batch)
    # Native CPU kernel (causal, reads the paged cache directly): set for passes without an
    # explicit mask when the kernel is available.
    native_attention: bool = False
    seq_index: torch.Tensor | None = None  # [T] int64: the sequence (row of block_tables) of each token
    positions: torch.Tensor | None = None  # [T] int64: each token's position (it sees keys 0..position)
    # Row ranges the native kernel runs as separate calls, so that the per-chunk partial results it
    # keeps per query stay bounded (a long prefill pass); None: one call. Rows are independent.
    native_slices: list[tuple[int, int]] | None = None
    # The model may run its layers in one native call (models/llama.py): native, in one slice.
    one_call: bool = False


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """One layer's cache, zero-filled: masked-out slots are multiplied by 0 in attention, which
    needs finite values."""
    return torch.zeros(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[T, Hkv, D]`` at their slots."""
    block_size = cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    cache[0][blocks, :, offsets] = k.to(cache.dtype)
    cache[1][blocks, :, offsets] = v.to(cache.dtype)


def read_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each table's keys and values in token order: ``[*block_tables.shape[:-1], blocks * block_size,
    Hkv, D]``."""
    _, _, hkv, block_size, d = cache.shape
    lead = block_tables.shape[:-1]

    def tokens(half: torch.Tensor) -> torch.Tensor:  # [..., blocks, Hkv, bs, D] -> [..., blocks * bs, Hkv, D]
        return half[block_tables].transpose(-3, -2).reshape(*lead, -1, hkv, d)

    return tokens(cache[0]), tokens(cache[1])


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.native_attention:
        kernels = native_kernels()
        if meta.native_slices is None:
            return kernels.paged_attention_decode(q, cache, meta.block_tables, meta.seq_index, meta.positions, scale)
        return torch.cat([kernels.paged_attention_decode(q[a:b], cache, meta.block_tables, meta.seq_index[a:b],
                                                         meta.positions[a:b], scale) for a, b in meta.native_slices])
    if meta.batch_invariant:
        return paged_attention_invariant(q, cache, meta, scale)
    return paged_attention_sdpa(q, cache, meta, scale)


def _gather(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata):
    """Padded queries [B, q_max, Hq, D] and each sequence's keys/values [B, k_max, Hkv, D]."""
    t, hq, d = q.shape
    bsz = meta.block_tables.shape[0]
    keys, values = read_kv(cache, meta.block_tables)
    keys, values = keys[:, : meta.k_max].to(q.dtype), values[:, : meta.k_max].to(q.dtype)
    if meta.pad_index is None:
        qp = q.view(bsz, meta.q_max, hq, d)
    else:
        qp = q.index_select(0, meta.pad_index).view(bsz, meta.q_max, hq, d)
    return qp, keys, values


def _unpad(out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    bsz, q_max, hq, d = out.shape
    out = out.reshape(bsz * q_max, hq, d)
    return out if meta.unpad_index is None else out.index_select(0, meta.unpad_index)


def paged_attention_invariant(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Batch-invariant backend: a query's output is bit-identical whether it is computed alone
    (decode), inside a multi-token window (verification) or next to other sequences.

    Dot products reduce over head_dim with the same shape for every query, and both sums over
    keys are sequential scans (``cumsum``), to which masked keys add exact zeros. Costs
    O(q * k * head_dim) memory per layer, so it serves decode and verify steps, not prefill.
    """
    qp, keys, values = _gather(q, cache, meta)
    bsz, q_max, hq, d = qp.shape
    k_max, hkv = keys.shape[1], keys.shape[2]
    group = hq // hkv
    qg = qp.reshape(bsz, q_max, hkv, group, 1, d)
    kk = keys.permute(0, 2, 1, 3).reshape(bsz, 1, hkv, 1, k_max, d)
    scores = (qg * kk).sum(-1) * scale  # [B, q_max, Hkv, group, k_max]
    if meta.mask is not None:
        scores = scores.masked_fill(~meta.mask.view(bsz, q_max, 1, 1, k_max), float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    denom = weights.cumsum(-1)[..., -1:]
    vv = values.permute(0, 2, 1, 3).reshape(bsz, 1, hkv, 1, k_max, d)
    numer = (weights.unsqueeze(-1) * vv).cumsum(-2)[..., -1, :]
    return _unpad((numer / denom).reshape(bsz, q_max, hq, d), meta)


def paged_attention_sdpa(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Reference backend. q: [T, Hq, D] -> out: [T, Hq, D]."""
    qp, keys, values = _gather(q, cache, meta)
    hq, hkv = qp.shape[2], keys.shape[2]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=hq != hkv,
    )  # [B, Hq, q_max, D]
    return _unpad(out.transpose(1, 2), meta)
