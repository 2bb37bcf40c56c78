"""Tiny random HF checkpoints (Llama, Llama-3 RoPE scaling, Qwen2, Qwen3), built with
transformers itself, randomized with a fixed seed and saved as safetensors, so the tests need no
network and no model hub. They carry no tokenizer files: prompts are lists of token ids.

Test modules import the builders from here; `conftest.py` holds only fixtures and hooks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

TINY_VOCAB = 256


@dataclass(frozen=True)
class TinyCheckpoint:
    name: str
    path: Path
    architecture: str
    tied: bool
    sharded: bool

    def __str__(self) -> str:  # nice pytest ids / messages
        return self.name


def llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kw))


def qwen2(**overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, use_sliding_window=False,
    )
    kw.update(overrides)
    return Qwen2ForCausalLM(Qwen2Config(**kw))


def qwen3(**overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # q_size (128) != hidden (64)
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2, use_sliding_window=False,
    )
    kw.update(overrides)
    return Qwen3ForCausalLM(Qwen3Config(**kw))


# name -> (builder, builder kwargs, max_shard_size or None)
TINY_SPECS = {
    "llama-gqa-tied": (llama, dict(tie_word_embeddings=True), None),
    "llama3-rope-untied-sharded": (
        llama,
        dict(
            tie_word_embeddings=False,
            num_key_value_heads=1,  # multi-query attention
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        ),
        "100KB",
    ),
    "qwen2-bias-untied": (qwen2, dict(tie_word_embeddings=False), None),
    "qwen3-qknorm-tied": (qwen3, dict(tie_word_embeddings=True), None),
}
TINY_NAMES = list(TINY_SPECS)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded values of a healthy scale.

    transformers' default init (std 0.02, norms 1, biases 0) gives nearly uniform logits and
    leaves norm weights and biases untested; here linear weights are ~N(0, 1/fan_in) (unit-scale
    activations), embeddings ~N(0, 0.1^2) (larger tied embeddings make the model just
    repeat its input token), every RMSNorm weight (incl. Qwen3 q/k norms) is
    uniform in [0.5, 1.5] and every bias (Qwen2 q/k/v) is ~N(0, 0.3^2).
    """
    gen = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied lm_head / embedding
            continue
        seen.add(id(p))
        if name.endswith("norm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            raise AssertionError(f"unexpected parameter {name} {tuple(p.shape)}")


def build_tiny_checkpoint(name: str, root: Path, seed: int) -> TinyCheckpoint:
    builder, kwargs, shard = TINY_SPECS[name]
    torch.manual_seed(seed)
    model = builder(**kwargs).float().eval()
    randomize_(model, seed)
    cfg = model.config
    if getattr(cfg, "tie_word_embeddings", False):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    path = root / name
    save_kw = {"safe_serialization": True}
    if shard:
        save_kw["max_shard_size"] = shard
    model.save_pretrained(path, **save_kw)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if shard:
        assert (path / "model.safetensors.index.json").is_file(), files
        assert len(files) > 1, f"{name} was meant to be sharded, got {files}"
    saved = json.loads((path / "config.json").read_text())
    assert saved["model_type"] == cfg.model_type
    return TinyCheckpoint(
        name=name, path=path, architecture=cfg.model_type,
        tied=bool(kwargs.get("tie_word_embeddings")), sharded=bool(shard),
    )
