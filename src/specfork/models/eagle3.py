"""The EAGLE-3 draft head: one decoder layer that reads the target's own features.

At position t the head combines the target's features there (the inputs of a low, a middle and a
high layer, projected from 3d to d by ``fc``) with the embedding of the next token x_{t+1} (the
target's embedding), and predicts x_{t+2} over its reduced draft vocabulary:

    h = fc(features_t)  (or, past the verified tokens, the head's own output at t - 1)
    a = [input_layernorm(embed(x_{t+1})), hidden_norm(h)]            (2d wide)
    h1 = h + attention(a)       (its own paged KV cache, RoPE at t)
    out = h1 + mlp(post_attention_layernorm(h1))
    logits = lm_head(norm(out))  [draft vocabulary];  ``draft_to_target`` maps its ids.

``out`` stands in for the features of the next position when the head drafts a chain on its
own. The module knows nothing of speculation; the proposer drives it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specfork.layers.attention import AttentionMetadata
from specfork.layers.fused_layer import fuse_decoder_layer, fuse_eagle3_step
from specfork.layers.linear import make_linear
from specfork.layers.norm import RMSNorm
from specfork.layers.rotary import RotaryEmbedding
from specfork.loading.eagle3 import Eagle3Config
from specfork.models.llama import MLP, Attention, WeightSource, need


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, take: WeightSource, embed_tokens: nn.Embedding,
                 draft_to_target: torch.Tensor, max_positions: int) -> None:
        super().__init__()
        arch = cfg.arch
        self.config = arch  # one layer: what a ModelRunner needs to size the head's KV cache
        self.head_config = cfg
        self.embed_tokens = embed_tokens
        eps = arch.rms_norm_eps
        self.fc = make_linear(need(take, "fc.weight"))
        self.input_layernorm = RMSNorm(need(take, "midlayer.input_layernorm.weight"), eps)
        self.hidden_norm = RMSNorm(need(take, "midlayer.hidden_norm.weight"), eps)
        self.self_attn = Attention(arch, take, "midlayer.self_attn")
        self.post_attention_layernorm = RMSNorm(need(take, "midlayer.post_attention_layernorm.weight"), eps)
        self.mlp = MLP(take, "midlayer.mlp")
        self.norm = RMSNorm(need(take, "norm.weight"), eps)
        self.lm_head = make_linear(need(take, "lm_head.weight"))
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.register_buffer("draft_to_target", draft_to_target.to(torch.long), persistent=False)
        attn = self.self_attn
        # One native call for decode steps (the native kernel with the attention's input given).
        self.fused_decode = fuse_decoder_layer(
            self.input_layernorm, (attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj),
            self.post_attention_layernorm, attn.num_heads, attn.num_kv_heads, attn.scale,
        )
        # ... and for the whole step where fc and the LM head are native too: one call from fc to logits.
        self.fused_step = fuse_eagle3_step(self.fused_decode, self.fc, embed_tokens.weight, self.hidden_norm,
                                           self.norm, self.lm_head)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated features [T, 3 d_target] -> the head's input hidden [T, d]."""
        return self.fc(features.to(self.fc_dtype))

    @property
    def fc_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(
        self,
        next_ids: torch.Tensor,  # [T] x_{t+1}
        positions: torch.Tensor,  # [T] t
        hidden: torch.Tensor | None,  # [T, d] projected features or the head's own previous output
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        *,
        features: torch.Tensor | None = None,  # [T, 3 d_target] the target's features, with hidden None
        logit_rows: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's output at each position [T, d] (before the final norm), the draft-vocabulary
        logits of the rows ``logit_rows`` [R, draft_vocab] float32). The input is ``hidden``, or
        ``features`` projected by fc."""
        rope = self.rotary.at(positions)
        if meta.one_call and self.fused_step is not None:
            features = None if features is None else features.to(self.fc_dtype)
            return self.fused_step(next_ids, hidden, features, rope, kv_caches[0], meta, list(logit_rows))
        if hidden is None:
            hidden = self.project(features)
        a = torch.cat([self.input_layernorm(self.embed_tokens(next_ids)), self.hidden_norm(hidden)], dim=-1)
        if meta.one_call and self.fused_decode is not None:
            out = self.fused_decode(hidden, rope, kv_caches[0], meta, attn_input=a)
        else:
            h = hidden + self.self_attn(a, rope, kv_caches[0], meta)
            out = h + self.mlp(self.post_attention_layernorm(h))
        rows = list(logit_rows)
        if not rows:
            return out, out.new_empty(0, self.lm_head.out_features)
        return out, self.compute_logits(out if rows == list(range(len(out))) else out[rows])

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, draft_vocab], float32."""
        return self.lm_head(self.norm(out)).float()
