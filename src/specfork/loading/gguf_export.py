"""Write a Llama-architecture HF checkpoint as a GGUF file llama.cpp can load.

The inverse of :mod:`specfork.loading.gguf`: HF tensor names become GGUF names, q/k rows are
permuted into llama.cpp's interleaved RoPE layout, 2-D weights are stored in the chosen type
(``f32``, ``f16`` or ``q8_0``) and norms in f32. The tokenizer metadata (``tokenizer.*``) is
copied from a GGUF that has the same vocabulary, normally the target's: llama.cpp needs it,
and it is what makes the file acceptable as that target's draft.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from specfork.errors import ModelLoadError, SpecforkError
from specfork.output_paths import check_output_file

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

OUT_TYPES = ("f32", "f16", "q8_0", "q4_1", "q4_0")

_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str | None:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        inner = ".".join(parts[3:-1])
        if inner in _HF_TO_GGUF_LAYER:
            return f"blk.{parts[2]}.{_HF_TO_GGUF_LAYER[inner]}.{parts[-1]}"
    return None


def permute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's half-split RoPE row order → llama.cpp's interleaved pairs (inverse of the loader's)."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _copy_tokenizer_fields(writer, vocab_gguf: Path, vocab_size: int) -> None:
    import gguf

    reader = gguf.GGUFReader(str(vocab_gguf))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SpecforkError(f"{vocab_gguf} has no tokenizer metadata to copy")
    if len(tokens.data) != vocab_size:
        raise SpecforkError(
            f"{vocab_gguf} has {len(tokens.data)} tokens but the model's vocabulary is {vocab_size}; "
            "pass the GGUF of the target this draft was trained for"
        )
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)


def write_config(writer, arch, name: str, file_type) -> None:
    """The llama.* keys llama.cpp reads to build the model."""
    writer.add_name(name)
    for add, value in (
        (writer.add_context_length, arch.max_position_embeddings), (writer.add_embedding_length, arch.hidden_size),
        (writer.add_block_count, arch.num_layers), (writer.add_feed_forward_length, arch.intermediate_size),
        (writer.add_head_count, arch.num_heads), (writer.add_head_count_kv, arch.num_kv_heads),
        (writer.add_key_length, arch.head_dim), (writer.add_value_length, arch.head_dim),
        (writer.add_rope_dimension_count, arch.head_dim), (writer.add_layer_norm_rms_eps, arch.rms_norm_eps),
        (writer.add_rope_freq_base, arch.rope_theta), (writer.add_vocab_size, arch.vocab_size),
    ):
        add(value)
    writer.add_file_type(file_type)


def _write_tensors(writer, tensors: dict, arch, qtype) -> None:
    """Every weight under its GGUF name, q/k rows permuted to llama.cpp's RoPE layout, 2-D
    matrices quantised to ``qtype`` where their rows split into 32-value blocks."""
    import gguf

    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for hf, w in tensors.items():
        name = gguf_name(hf)
        if name is None:
            raise SpecforkError(f"export-gguf does not know where to put tensor {hf!r}")
        w = w.float()
        if name.endswith("attn_q.weight"):
            w = permute_rope_rows(w, arch.num_heads)
        elif name.endswith("attn_k.weight"):
            w = permute_rope_rows(w, arch.num_kv_heads)
        array = w.numpy().astype("float32")
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32 and array.shape[1] % 32 == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)


def export_gguf(checkpoint: str | Path, output: str | Path, *, vocab_from: str | Path | None, out_type: str = "q8_0") -> Path:
    """Write the HF checkpoint directory ``checkpoint`` to ``output`` (a ``.gguf`` file).

    ``vocab_from``: a GGUF file (or alias) whose tokenizer metadata is copied; None writes no
    tokenizer (specfork still loads the file, llama.cpp does not)."""
    import gguf

    from specfork.loading.eagle3 import is_eagle3_checkpoint
    from specfork.loading.resolve import CheckpointFormat, resolve_checkpoint
    from specfork.loading.safetensors import load_safetensors, read_hf_config

    if out_type not in OUT_TYPES:
        raise SpecforkError(f"unknown output type {out_type!r}; choose from {', '.join(OUT_TYPES)}")
    location = resolve_checkpoint(str(checkpoint))
    if location.format is not CheckpointFormat.HF_DIR:
        raise SpecforkError(f"{checkpoint} is not an HF checkpoint directory (config.json + safetensors)")
    if is_eagle3_checkpoint(location.path):
        raise SpecforkError(f"{checkpoint} is an EAGLE-3 head; export-gguf writes draft models (llama.cpp's GGUF "
                            "has no EAGLE-3 head layout), and specfork loads the head's directory as it is")
    arch = read_hf_config(location.path)
    if arch.architecture != "llama":
        raise SpecforkError(f"export-gguf writes Llama-architecture models; {checkpoint} is {arch.architecture!r}")
    if arch.rope_scaling is not None:
        raise SpecforkError("export-gguf does not write rope scaling yet; this checkpoint uses it")
    vocab_path = None
    if vocab_from is not None:
        vocab_location = resolve_checkpoint(str(vocab_from))
        if vocab_location.format is not CheckpointFormat.GGUF:
            raise SpecforkError(f"--vocab-from must be a GGUF file (or an alias of one); {vocab_from} is not")
        vocab_path = vocab_location.path
    output = Path(output)
    check_output_file(output, "the output")
    if vocab_path is not None and output.exists() and output.resolve() == Path(vocab_path).resolve():
        raise SpecforkError(f"the output {output} is the --vocab-from model itself; writing it would replace that model")
    tensors = load_safetensors(location.path)
    qtype = {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
    }[out_type]
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[out_type]

    fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.writing-", dir=output.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _write_gguf(gguf, tmp, arch, location.path.name, file_type, vocab_path, tensors, qtype)
        tmp.chmod(0o644)  # mkstemp's 0600 would become the published file's
        tmp.replace(output)
    finally:
        tmp.unlink(missing_ok=True)
    try:
        gguf.GGUFReader(str(output))
    except Exception as e:  # pragma: no cover - a writer bug, not user input
        raise ModelLoadError(f"the GGUF just written to {output} does not read back: {e}") from None
    return output


def _write_gguf(gguf, path: Path, arch, name: str, file_type, vocab_path: Path | None, tensors: dict, qtype) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    write_config(writer, arch, name, file_type)
    if vocab_path is not None:
        _copy_tokenizer_fields(writer, vocab_path, arch.vocab_size)
    else:
        logger.warning("no --vocab-from GGUF: writing no tokenizer metadata (llama.cpp will not load this file)")
        if arch.bos_token_id is not None:
            writer.add_bos_token_id(arch.bos_token_id)
        if arch.eos_token_ids:
            writer.add_eos_token_id(arch.eos_token_ids[0])
    _write_tensors(writer, tensors, arch, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
