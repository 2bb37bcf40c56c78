"""Random but well-formed GGUF blocks of every format the native path unpacks, and a tiny Llama GGUF
built from them: the ``gguf`` package dequantises every format but quantises only the simple ones,
so the k-quant and IQ4 tests draw the integer fields at random and set each block's fp16 scales to a
healthy size (weights of roughly ``scale`` in magnitude)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specfork.layers.gguf_blocks import BLOCK_BYTES, BLOCK_VALUES

# Byte offsets of each format's fp16 fields, and the size of its integer weight times its scale
# field (so that d = scale / size gives weights of about ``scale``).
_FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
                "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
_SIZE = {"Q4_0": 8, "Q4_1": 8, "Q8_0": 128, "Q5_0": 16, "Q5_1": 16, "Q2_K": 2 * 8, "Q3_K": 4 * 32, "Q4_K": 8 * 32,
         "Q5_K": 16 * 32, "Q6_K": 32 * 64, "IQ4_NL": 127, "IQ4_XS": 127 * 16}
_MINIMA = {2, 82}  # the fp16 fields holding minima (Q4_1 / Q5_1's m, the k-quants' dmin)


def random_blocks(type_name: str, n: int, k: int, seed: int = 0, scale: float = 0.05) -> np.ndarray:
    """[n, row_bytes] uint8: n rows of k values in ``type_name``'s blocks."""
    rng = np.random.default_rng(seed)
    per_block, block_bytes = BLOCK_VALUES[type_name], BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, size=(n, k // per_block, block_bytes), dtype=np.uint8)
    for start in _FP16_FIELDS[type_name]:
        # a signed d (Q6_K's scales are signed too); minima of Q4_1/Q5_1 and dmin of k-quants about half as large
        size = scale / _SIZE[type_name] * (0.5 if start in _MINIMA else 1.0)
        values = (rng.uniform(0.5, 1.5, size=raw.shape[:-1]) * size * rng.choice([-1.0, 1.0], size=raw.shape[:-1]))
        raw[..., start : start + 2] = values.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def k_quant_llama_gguf(path: Path, types: dict[str, str], seed: int = 0) -> Path:
    """A tiny Llama (hidden 256, 2 layers, 4 heads of 64, 2 KV heads, MLP 512, vocabulary 256, tied
    embeddings) whose matrices are random blocks: ``types`` maps a GGUF tensor name's last part
    ("attn_q", "ffn_down", "token_embd", ...) to its format; norms are float32 ones."""
    import gguf

    from specfork.loading.gguf_export import write_config
    from specfork.models.config import ModelArchConfig

    hidden, inter, layers, heads, kv_heads, vocab = 256, 512, 2, 4, 2, 256
    arch = ModelArchConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                           num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                           rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    write_config(writer, arch, "tiny-k-quants", gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * 64, hidden), "attn_v": (kv_heads * 64, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    rng = np.random.default_rng(seed)
    counter = 0

    def matrix(name: str, kind: str, shape: tuple[int, int]) -> None:
        nonlocal counter
        counter += 1
        type_name = types[kind]
        n, k = shape
        qtype = getattr(gguf.GGMLQuantizationType, type_name)
        raw = random_blocks(type_name, n, k, seed=seed * 1000 + counter, scale=2.0 / np.sqrt(k))
        writer.add_tensor(name, raw, raw_dtype=qtype)

    matrix("token_embd.weight", "token_embd", (vocab, hidden))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        for kind, shape in shapes.items():
            matrix(f"blk.{i}.{kind}.weight", kind, shape)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
