"""Tiny random EAGLE-3 heads written in the ecosystem's layout, and a plain reimplementation of
the head's forward (full causal attention over a sequence, nothing paged) to check against."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from specfork.loading.eagle3 import Eagle3Config, save_eagle3
from specfork.models.config import ModelArchConfig


def write_tiny_head(path: Path, target_dir: Path, *, draft_ids: list[int], feature_layers=None, seed: int = 0,
                    scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A random head for the HF target in ``target_dir``; returns its float32 tensors."""
    raw = json.loads((Path(target_dir) / "config.json").read_text())
    arch = ModelArchConfig.from_hf_dict({**raw, "num_hidden_layers": 1})
    d, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features, in_features, gain=1.0):
        return gain * torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)

    def norm():
        return 0.5 + torch.rand(d, generator=gen)

    tensors = {
        "fc.weight": linear(d, 3 * d),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": linear(q, 2 * d),
        "midlayer.self_attn.k_proj.weight": linear(kv, 2 * d),
        "midlayer.self_attn.v_proj.weight": linear(kv, 2 * d),
        "midlayer.self_attn.o_proj.weight": linear(d, q),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": linear(arch.intermediate_size, d),
        "midlayer.mlp.up_proj.weight": linear(arch.intermediate_size, d),
        "midlayer.mlp.down_proj.weight": linear(d, arch.intermediate_size),
        "norm.weight": norm(),
        "lm_head.weight": linear(len(draft_ids), d, gain=scale),
    }
    config = Eagle3Config(arch=arch, draft_vocab_size=len(draft_ids),
                          feature_layers=tuple(feature_layers) if feature_layers else None, target_hidden_size=d)
    save_eagle3(path, config, tensors, torch.tensor(draft_ids), dtype=torch.float32)
    return tensors


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, theta):
    """HF Llama rotary embedding (rotate half) of x [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float64) / half)
    angles = positions.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1).float()[:, None], torch.cat([angles.sin()] * 2, -1).float()[:, None]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def plain_head_logits(tensors, embed, arch: ModelArchConfig, features, next_ids, positions):
    """Draft-vocabulary logits of a sequence, [T, draft_vocab]: every position attends to every
    earlier one (the head's own KV cache holds all of them)."""
    return plain_head(tensors, embed, arch, features @ tensors["fc.weight"].T, next_ids, positions)[0]


def plain_head(tensors, embed, arch: ModelArchConfig, h, next_ids, positions):
    """(logits [T, draft_vocab], outputs [T, d]) of the head over input hiddens ``h`` [T, d]
    (projected features, or the head's own earlier outputs)."""
    eps, heads, kv_heads, hd = arch.rms_norm_eps, arch.num_heads, arch.num_kv_heads, arch.head_dim
    t = h.shape[0]
    a = torch.cat([_rms(embed[next_ids], tensors["midlayer.input_layernorm.weight"], eps),
                   _rms(h, tensors["midlayer.hidden_norm.weight"], eps)], dim=-1)
    q = _rope((a @ tensors["midlayer.self_attn.q_proj.weight"].T).view(t, heads, hd), positions, arch.rope_theta)
    k = _rope((a @ tensors["midlayer.self_attn.k_proj.weight"].T).view(t, kv_heads, hd), positions, arch.rope_theta)
    v = (a @ tensors["midlayer.self_attn.v_proj.weight"].T).view(t, kv_heads, hd)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * hd)
    h = h + attn @ tensors["midlayer.self_attn.o_proj.weight"].T
    x = _rms(h, tensors["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = x @ tensors["midlayer.mlp.gate_proj.weight"].T, x @ tensors["midlayer.mlp.up_proj.weight"].T
    h = h + (torch.nn.functional.silu(gate) * up) @ tensors["midlayer.mlp.down_proj.weight"].T
    return _rms(h, tensors["norm.weight"], eps) @ tensors["lm_head.weight"].T, h


HEAD_DRAFT_IDS = [0, 2, 3, 5]  # of the lossless target's 8 tokens: 1, 4, 6 and 7 are outside the head's vocabulary


def head_models(root: Path) -> dict:
    """The lossless tests' target and, as draft, a tiny head over a reduced vocabulary: sharp
    enough that chains are accepted often enough to reach later rounds with several tokens."""
    from lossless import tiny_model

    hf_target = tiny_model(root / "target", seed=11)
    write_tiny_head(root / "head", root / "target", draft_ids=HEAD_DRAFT_IDS, feature_layers=(0, 1, 1), seed=3,
                    scale=3.0)
    return {"target": str(root / "target"), "draft": str(root / "head"), "hf_target": hf_target}
