"""One native call per decoder layer for decode and verification steps (and prefill passes).

Driven from Python, a decode step of a small model spends about as long in per-op overhead (some
25 tensor ops and 8 module calls per layer) as in the work itself. ``csrc/decoder_layer.cpp`` runs
a whole Llama decoder layer (norms, the four quantised projections, rotary, KV-cache write, paged
attention, SiLU gating, residuals) in one call and one OpenMP parallel region (the threads meet at
barriers between stages), with the same kernels and element-wise arithmetic as the module path, so
its output is bit-identical to it. It serves passes that the native paged-attention kernel runs
in one call (``AttentionMetadata.one_call``) on layers whose projections all run the native
quantised kernel; anything else takes the module path.

``FusedDecoderStack`` goes one step further for a model whose every layer fuses: all layers, the
final norm and the LM head in one call and one parallel region (``DecoderStack.forward``, the same
per-layer code in a C++ loop), so a decode step returns to Python once instead of once per layer.
The native ``DecoderStack`` holds the weights from the model's construction on, so a step passes
only what changes; so does ``Eagle3Step``, an EAGLE-3 head's whole step (``FusedEagle3Step``).
"""

from __future__ import annotations

import torch

from specfork.layers.attention import AttentionMetadata
from specfork.layers.norm import RMSNorm
from specfork.layers.quantized import QuantizedLinear
from specfork.layers.rotary import RopeTables
from specfork.native_kernels import kernels as native_kernels


def _rope_tables(rope: RopeTables, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole rotary tables: the native forward reads them at ``meta.positions``, which must be
    the positions the rotation was asked for (``ModelRunner.prepare`` returns that tensor)."""
    if rope.positions is not meta.positions:
        raise ValueError("a native forward rotates at the attention metadata's positions; pass prepare()'s positions")
    return rope.table_cos, rope.table_sin_signed


class FusedDecodeLayer:
    def __init__(self, kernels, weights: list[torch.Tensor], formats: list[int], num_heads: int,
                 num_kv_heads: int, eps: float, scale: float) -> None:
        self._kernels = kernels
        self._weights, self._formats = weights, formats
        self._heads = (num_heads, num_kv_heads)
        self._eps, self._scale = eps, scale
        self._no_input = torch.empty(0)  # attn_input of a Llama layer: attention reads rms_norm(x)

    def __call__(self, x: torch.Tensor, rope: RopeTables, cache: torch.Tensor, meta: AttentionMetadata,
                 attn_input: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for residual stream ``x``; ``attn_input``: what attention reads
        instead of ``rms_norm(x)`` (a layer shaped like EAGLE-3's head), None for a Llama layer."""
        return self._kernels.decoder_layer_decode(
            x.contiguous(), self._no_input if attn_input is None else attn_input, self._weights, self._formats, *_rope_tables(rope, meta), cache, meta.block_tables,
            meta.seq_index, meta.positions, meta.slot_mapping, *self._heads, self._eps, self._scale,
        )


def fuse_decoder_layer(input_norm: RMSNorm, projections: tuple, post_norm: RMSNorm, num_heads: int,
                       num_kv_heads: int, scale: float) -> FusedDecodeLayer | None:
    """``projections``: qkv, o, gate_up, down. None where the fused layer cannot run this layer."""
    kernels = native_kernels()
    if kernels is None or not all(isinstance(p, QuantizedLinear) for p in projections):
        return None
    if input_norm.eps != post_norm.eps or any(n.weight.dtype != torch.float32 for n in (input_norm, post_norm)):
        return None
    weights, formats = [input_norm.weight, post_norm.weight], []
    for p in projections:
        bias = p.bias if p.bias is not None else torch.empty(0)
        weights += [p.values, p.scales, p.offsets, bias]
        formats += [p.out_features, p.format]
    return FusedDecodeLayer(kernels, weights, formats, num_heads, num_kv_heads, input_norm.eps, scale)


class FusedDecoderStack:
    def __init__(self, layers: list[FusedDecodeLayer], final_norm: RMSNorm, lm_head) -> None:
        first = layers[0]
        head_weights, head_format = [], []
        if isinstance(lm_head, QuantizedLinear):  # else the caller runs its LM head
            head_weights, head_format = _projection(lm_head)
        self.native_head = bool(head_weights)
        # Prepared once: a step passes only what changes. Passing the 540 weight tensors of a
        # 30-layer model with every call cost 0.2-0.3 ms of a ~5 ms decode step (docs/decisions.md).
        self._stack = first._kernels.DecoderStack(
            [layer._weights for layer in layers], [layer._formats for layer in layers], *first._heads, first._eps,
            first._scale, final_norm.weight, final_norm.eps, head_weights, head_format)

    def __call__(self, x: torch.Tensor, rope: RopeTables, caches: list[torch.Tensor], meta: AttentionMetadata,
                 capture: tuple[int, ...] = (), logits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden after the final norm, the inputs of the ``capture`` layers side by side (empty
        without), the LM head's logits of every row (empty unless ``logits`` and the LM head is
        native))."""
        hidden, features, out = self._stack.forward(
            x.contiguous(), caches, *_rope_tables(rope, meta), meta.block_tables, meta.seq_index, meta.positions,
            meta.slot_mapping, list(capture), logits and self.native_head,
        )
        return hidden, features, out

    def decode_steps(self, x: torch.Tensor, embedding: torch.Tensor, rope: RopeTables, caches: list[torch.Tensor],
                     meta: AttentionMetadata, positions: torch.Tensor, slots: torch.Tensor, draws,
                     capture: tuple[int, ...] = (), logprobs: list[int] | None = None) -> list[torch.Tensor]:
        """The tokens [steps, B] of ``steps`` decode steps run back to back in one call: ``x`` [B, H]
        the first step's input, ``positions`` and ``slots`` [steps, B] each step's rows (``meta``'s
        block tables cover the last), each step's tokens (``draws``, a ``sampling.StepDraws``: the
        argmax of a greedy row, a sampled row's draw, after the row's logit adjustments) looked up in ``embedding`` [V, H] for the next;
        and the inputs of the ``capture`` layers of every step's rows, step by step [steps * B,
        |capture| H] (empty without ``capture``); with ``logprobs`` (per row the alternatives it
        reports, -1: none), each step's log-probability of each row's token [steps, B] and the ids
        and log-probabilities of its alternatives [steps, B, the most a row wants] (empty without)."""
        cos, sin = rope.table_cos, rope.table_sin_signed
        return self._stack.decode_steps(
            x.contiguous(), embedding, caches, cos, sin, meta.block_tables, meta.seq_index, positions.contiguous(),
            slots.contiguous(), draws.temperature, draws.top_k, draws.top_p, draws.uniforms, list(capture),
            list(draws.adjustments), logprobs or [])


def fuse_decoder_stack(layers: list[FusedDecodeLayer | None], final_norm: RMSNorm, lm_head) -> FusedDecoderStack | None:
    """The whole stack in one call, where every layer fuses alike and the final norm runs natively
    (the LM head too, when it is a native quantised projection)."""
    if not layers or any(layer is None for layer in layers) or final_norm.weight.dtype != torch.float32:
        return None
    if not final_norm.weight.is_contiguous():
        return None
    first = layers[0]
    if any((layer._heads, layer._eps, layer._scale) != (first._heads, first._eps, first._scale) for layer in layers):
        return None
    return FusedDecoderStack(layers, final_norm, lm_head)


def _projection(p: QuantizedLinear) -> tuple[list[torch.Tensor], list[int]]:
    return [p.values, p.scales, p.offsets, p.bias if p.bias is not None else torch.empty(0)], [p.out_features, p.format]


class FusedEagle3Step:
    def __init__(self, layer: FusedDecodeLayer, fc: QuantizedLinear, embedding: torch.Tensor, hidden_norm: RMSNorm,
                 final_norm: RMSNorm, lm_head: QuantizedLinear) -> None:
        # Prepared once, as the decoder stack is: a step passes only what changes.
        self._step = layer._kernels.Eagle3Step(*_projection(fc), embedding, hidden_norm.weight, final_norm.weight,
                                               layer._weights, layer._formats, *layer._heads, layer._eps,
                                               layer._scale, *_projection(lm_head))

    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor | None, features: torch.Tensor | None,
                 rope: RopeTables, cache: torch.Tensor, meta: AttentionMetadata,
                 logit_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's outputs [T, d], the LM head's logits of ``logit_rows`` [R, draft vocab]);
        the input is ``hidden`` [T, d], or ``features`` [T, 3 d_target] through fc."""
        return self._step.forward(
            features if hidden is None else hidden, hidden is None, ids, *_rope_tables(rope, meta), cache,
            meta.block_tables, meta.seq_index, meta.positions, meta.slot_mapping, logit_rows,
        )


def fuse_eagle3_step(layer: FusedDecodeLayer | None, fc, embedding: torch.Tensor, hidden_norm: RMSNorm,
                     final_norm: RMSNorm, lm_head) -> FusedEagle3Step | None:
    """The head's step in one call, where its layer fuses, fc and the LM head are native quantised
    projections and the embedding and norms are float32 (None elsewhere: the module path)."""
    if layer is None or not isinstance(fc, QuantizedLinear) or not isinstance(lm_head, QuantizedLinear):
        return None
    if embedding.dtype != torch.float32 or embedding.device.type != "cpu" or not embedding.is_contiguous():
        return None
    if any(n.weight.dtype != torch.float32 or n.eps != layer._eps for n in (hidden_norm, final_norm)):
        return None
    return FusedEagle3Step(layer, fc, embedding, hidden_norm, final_norm, lm_head)
