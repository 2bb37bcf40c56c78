"""Attention over a paged KV cache.

The cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(keys, then values). A sequence owns a list of blocks (its block table); token ``i`` of the
sequence lives in block ``block_table[i // block_size]`` at offset ``i % block_size``.

The reference backend gathers each sequence's blocks and runs
``torch.nn.functional.scaled_dot_product_attention`` with an explicit boolean mask, so causal
prefill, decode, multi-token verification windows and tree masks are all the same code path:
the caller states which keys each query may see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values ``[T, Hkv, D]`` at their slots."""
    _, num_blocks, block_size, hkv, d = cache.shape
    cache[0].view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, k)
    cache[1].view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, v)


def paged_attention_sdpa(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Reference backend. q: [T, Hq, D] -> out: [T, Hq, D]."""
    t, hq, d = q.shape
    bsz = meta.block_tables.shape[0]
    block_size, hkv = cache.shape[2], cache.shape[3]
    # Gather each sequence's blocks: [B, max_blocks * block_size, Hkv, D], cut to k_max.
    keys = cache[0][meta.block_tables].view(bsz, -1, hkv, d)[:, : meta.k_max]
    values = cache[1][meta.block_tables].view(bsz, -1, hkv, d)[:, : meta.k_max]
    if meta.pad_index is None:
        qp = q.view(bsz, meta.q_max, hq, d)
    else:
        qp = q.index_select(0, meta.pad_index).view(bsz, meta.q_max, hq, d)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=hq != hkv,
    )  # [B, Hq, q_max, D]
    out = out.transpose(1, 2).reshape(bsz * meta.q_max, hq, d)
    if meta.unpad_index is None:
        return out
    return out.index_select(0, meta.unpad_index)
