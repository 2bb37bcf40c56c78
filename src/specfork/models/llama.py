"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Modules are built directly from a state dict with HF parameter names. q/k/v and gate/up
projections are fused into one linear layer each. The model computes hidden states for a flat
batch of new tokens; which keys each token sees is decided by the attention metadata, so the
model knows nothing about how tokens were scheduled or proposed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specfork.errors import MissingTensorError, ModelLoadError
from specfork.layers.activation import silu_and_mul
from specfork.layers.attention import AttentionMetadata, paged_attention, write_kv
from specfork.layers.fused_layer import FusedDecoderStack, fuse_decoder_layer, fuse_decoder_stack
from specfork.layers.linear import make_linear
from specfork.layers.norm import RMSNorm
from specfork.layers.quantized import QuantizedWeight, dense
from specfork.layers.rotary import RopeTables, RotaryEmbedding
from specfork.models.config import ModelArchConfig

WeightSource = Callable[[str], torch.Tensor | QuantizedWeight | None]
# Sums the partial outputs of a row-parallel projection (o, down) over tensor-parallel ranks.
Reduce = Callable[[torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, take: WeightSource, prefix: str, reduce: Reduce | None = None) -> None:
        super().__init__()
        self.reduce = reduce
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        weight = torch.cat([need(take, f"{prefix}.{n}_proj.weight") for n in ("q", "k", "v")])
        bias = None
        if cfg.qkv_bias:
            bias = torch.cat([need(take, f"{prefix}.{n}_proj.bias") for n in ("q", "k", "v")])
        self.qkv_proj = make_linear(weight, bias)
        self.o_proj = make_linear(need(take, f"{prefix}.o_proj.weight"), take(f"{prefix}.o_proj.bias"))
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(need(take, f"{prefix}.q_norm.weight"), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(need(take, f"{prefix}.k_norm.weight"), cfg.rms_norm_eps)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: RopeTables, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv[:, : self.num_heads + self.num_kv_heads], qkv[:, self.num_heads + self.num_kv_heads :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], dim=1)
        qk = rope.apply(qk)  # q and k heads rotated in one pass
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        write_kv(cache, k, v, meta.slot_mapping)
        out = self.o_proj(paged_attention(q, cache, meta, self.scale).reshape(t, self.q_size))
        return out if self.reduce is None else self.reduce(out)


class MLP(nn.Module):
    def __init__(self, take: WeightSource, prefix: str, reduce: Reduce | None = None) -> None:
        super().__init__()
        self.reduce = reduce
        gate, up = need(take, f"{prefix}.gate_proj.weight"), need(take, f"{prefix}.up_proj.weight")
        self.gate_up_proj = make_linear(torch.cat([gate, up]))
        self.down_proj = make_linear(need(take, f"{prefix}.down_proj.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, take: WeightSource, prefix: str, reduce: Reduce | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(need(take, f"{prefix}.input_layernorm.weight"), cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, take, f"{prefix}.self_attn", reduce)
        self.post_attention_layernorm = RMSNorm(
            need(take, f"{prefix}.post_attention_layernorm.weight"), cfg.rms_norm_eps
        )
        self.mlp = MLP(take, f"{prefix}.mlp", reduce)
        attn = self.self_attn
        # One native call for decode/verify steps (layers/fused_layer.py); not for a tensor-parallel
        # shard, whose partial sums meet between the projections.
        self.fused_decode = None
        if attn.q_norm is None and reduce is None:
            self.fused_decode = fuse_decoder_layer(
                self.input_layernorm, (attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj),
                self.post_attention_layernorm, attn.num_heads, attn.num_kv_heads, attn.scale,
            )

    def forward(self, x, rope, cache, meta):
        if meta.one_call and self.fused_decode is not None:
            return self.fused_decode(x, rope, cache, meta)
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Embedding → N decoder layers → final norm → LM head (tied or not).

    ``reduce``: the model is one tensor-parallel shard (``cfg`` counts this shard's heads and
    units; models/tensor_parallel.py) and ``reduce`` sums o's and down's partial outputs over the shards."""

    def __init__(self, cfg: ModelArchConfig, take: WeightSource, max_positions: int,
                 reduce: Reduce | None = None) -> None:
        super().__init__()
        self.config = cfg
        embed = need(take, "model.embed_tokens.weight")
        self.embed_tokens = nn.Embedding.from_pretrained(dense(embed), freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, take, f"model.layers.{i}", reduce) for i in range(cfg.num_layers))
        self.norm = RMSNorm(need(take, "model.norm.weight"), cfg.rms_norm_eps)
        head = take("lm_head.weight")
        if head is None:
            if not cfg.tie_word_embeddings:
                raise ModelLoadError("checkpoint has no lm_head.weight and does not tie word embeddings")
            self.lm_head = make_linear(embed if isinstance(embed, QuantizedWeight) else self.embed_tokens.weight)
        else:
            self.lm_head = make_linear(head)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # Decode/verify steps of a model whose layers all fuse: one native call for all of them.
        self.fused_stack = fuse_decoder_stack([layer.fused_decode for layer in self.layers], self.norm, self.lm_head)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        capture: tuple[int, ...] = (),
        *,
        logits: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states after the final norm, [T, hidden]; with ``logits``, the float32 logits of
        every row [T, vocab] in their place (on the one-call native path the LM head runs inside
        that call). With ``capture`` (layer indices), also the features a feature-reading drafter
        (EAGLE-3) needs: the input of each listed layer (the residual stream after the layers
        before it), concatenated in the listed order, [T, len(capture) * hidden]. Capturing
        changes nothing that is computed."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.at(positions)
        if meta.one_call and self.fused_stack is not None:
            hidden, features, head_logits = self.fused_stack(x, rope, kv_caches, meta, capture, logits)
            if logits and head_logits.shape[0] != hidden.shape[0]:  # the call had no native LM head
                head_logits = self.compute_logits(hidden)
            out = head_logits if logits else hidden
            return (out, features) if capture else out
        inputs = {}
        for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if index in capture:
                inputs[index] = x
            x = layer(x, rope, cache, meta)
        out = self.compute_logits(self.norm(x)) if logits else self.norm(x)
        if not capture:
            return out
        return out, torch.cat([inputs[i] for i in capture], dim=-1)

    @property
    def decodes_in_one_call(self) -> bool:
        """Whether ``decode_steps`` can run: the one-call native stack with its LM head, and a float32
        embedding to feed the tokens back from."""
        embedding = self.embed_tokens.weight
        return (isinstance(self.fused_stack, FusedDecoderStack) and self.fused_stack.native_head
                and embedding.dtype == torch.float32
                and embedding.device.type == "cpu" and embedding.is_contiguous())

    def decode_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                     meta: AttentionMetadata, slots: torch.Tensor, draws,
                     capture: tuple[int, ...] = (), logprobs: list[int] | None = None) -> list[torch.Tensor]:
        """The tokens [steps, B] of ``steps`` decode steps of B sequences in one native call, each
        step's tokens the next one's input: ``input_ids`` [B] the first step's tokens, ``positions``
        and ``slots`` [steps, B] each step's positions and cache slots (``meta`` the last step's
        block tables and each row's sequence), ``draws`` (``sampling.StepDraws``) how each row's
        token is chosen; the inputs of the ``capture`` layers of every step's rows, step by step
        (as ``forward`` returns them); and, for the rows ``logprobs`` names (the alternatives each
        reports, -1: none), their log-probabilities (``FusedDecoderStack.decode_steps``). The same
        tokens, features, log-probabilities and cache contents as ``steps`` forwards with the
        sampler between them (``decodes_in_one_call`` must hold)."""
        x = self.embed_tokens(input_ids)
        return self.fused_stack.decode_steps(x, self.embed_tokens.weight, self.rotary.at(positions), kv_caches, meta,
                                             positions, slots, draws, capture, logprobs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def need(take: WeightSource, name: str) -> torch.Tensor:
    tensor = take(name)
    if tensor is None:
        raise MissingTensorError(name)
    return tensor
