"""Load GGUF files: architecture from metadata, tensors renamed to HF names (Llama q/k rows
un-permuted back to HF's RoPE layout), kept quantised for the native kernel or dequantised to
float32. The file is parsed once (:class:`GGUFFile`) and shared by the config, the tensors and
the tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from specfork.errors import ModelLoadError
from specfork.loading.gguf_file import GGUFFile, GGUFTensor
from specfork.models.config import ModelArchConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def open_gguf(path: Path) -> GGUFFile:
    return GGUFFile(path)


def read_gguf_config(reader: GGUFFile, path: Path) -> ModelArchConfig:
    arch = reader.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} (supported: llama, qwen2, qwen3)")

    def need(key: str):
        value = reader.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return _scalar(path, f"{arch}.{key}", value)

    def optional(key: str, default):
        value = reader.get(f"{arch}.{key}")
        return default if value is None else _scalar(path, f"{arch}.{key}", value)

    _refuse_unsupported_features(reader, arch, path)
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(optional("attention.key_length", hidden // heads))
    rotary = int(optional("rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ModelLoadError(f"{path}: RoPE on {rotary} of each head's {head_dim} dimensions is not supported")
    names = {t.name for t in reader.tensors}
    vocab = reader.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = reader.array_length("tokenizer.ggml.tokens")
    if vocab is None:
        raise ModelLoadError(f"{path}: GGUF metadata gives no vocabulary size")
    eos = reader.get("tokenizer.ggml.eos_token_id")
    scaling = None
    if optional("rope.scaling.type", "none") == "linear":
        scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    freq_tensor = reader.tensor("rope_freqs.weight")
    if freq_tensor is not None:
        # Llama 3.x GGUFs store their rope scaling as per-frequency divisors.
        scaling = {"rope_type": "freq_factors", "factors": dequantize_tensor(freq_tensor).tolist()}
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(optional("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(optional("rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in names,
        rope_scaling=scaling,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _scalar(path: Path, key: str, value):
    """A metadata value the model reads as one number: per-layer arrays (models whose layers
    differ) and text are refused by name."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or (
            isinstance(value, str) and not key.endswith(".type")):
        raise ModelLoadError(f"{path}: GGUF metadata {key} is {_kind(value)}, where specfork reads one number "
                             "(models whose layers differ are not supported)")
    if not isinstance(value, str) and not value > 0 and not key.endswith("epsilon"):
        raise ModelLoadError(f"{path}: GGUF metadata {key} must be positive, got {value!r}")
    return value


def _kind(value) -> str:
    return f"a list of {len(value)} values" if isinstance(value, (list, tuple)) or hasattr(value, "shape") else repr(value)


def _refuse_unsupported_features(reader: GGUFFile, arch: str, path: Path) -> None:
    """Settings llama.cpp applies that the model does not: refused, never run without them."""
    scaling = reader.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ModelLoadError(f"{path}: rope scaling {scaling!r} is not supported (supported: linear, and llama3's "
                             "rope_freqs)")
    experts = reader.get(f"{arch}.expert_count")
    if experts:
        raise ModelLoadError(f"{path}: mixture-of-experts models ({experts} experts) are not supported")


def gguf_name(name: str) -> str | None:
    """The GGUF spelling of an HF tensor name (``hf_name`` backwards)."""
    for gguf, hf in _GLOBAL_NAMES.items():
        if hf == name:
            return gguf
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    kinds = {hf: gguf for gguf, hf in _LAYER_NAMES.items()}
    if m is None or m.group(2) not in kinds:
        return None
    return f"blk.{m.group(1)}.{kinds[m.group(2)]}.{m.group(3)}"


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rope_rows(w, num_heads: int):
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs → HF's half-split layout)."""
    rows = w.shape[0]
    order = torch.arange(rows).reshape(num_heads, rows // num_heads // 2, 2).swapaxes(1, 2).reshape(rows)
    return w.rows(order) if hasattr(w, "rows") else w[order]


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor as float32 in PyTorch (row-major, HF) shape."""
    if tensor.type_name in ("F32", "F16"):
        return torch.from_numpy(tensor.data.astype(np.float32))
    if tensor.type_name == "BF16":
        bits = tensor.data.view("<u2").astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32).reshape(tensor.shape))
    import gguf  # every block-quantised type's dequantiser

    data = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.type_id))
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(tensor.shape))


def load_gguf_tensors(reader: GGUFFile, cfg: ModelArchConfig, path: Path, *, native: bool = False) -> dict:
    """HF-named tensors. With ``native``, matrices in a format :mod:`specfork.layers.gguf_blocks`
    unpacks stay quantised (:class:`QuantizedWeight`); everything else is dequantised to float32."""
    from specfork.layers.gguf_blocks import NATIVE_FORMATS, from_gguf_blocks

    tensors: dict = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        type_name = tensor.type_name
        try:
            w = None
            if native and type_name in NATIVE_FORMATS and len(tensor.shape) == 2:
                w = from_gguf_blocks(tensor.data, type_name, tensor.shape)
            if w is None:
                w = dequantize_tensor(tensor)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read {tensor.name} ({type_name}): {e}") from None
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rope_rows(w, cfg.num_heads)
        elif cfg.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rope_rows(w, cfg.num_kv_heads)
        tensors[name] = w
    return tensors
