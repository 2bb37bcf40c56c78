"""Settings of ``specfork train-draft``: the data, the draft's architecture and the training run.
Importing it costs nothing (no torch), so ``specfork --help`` stays fast."""

from __future__ import annotations

from dataclasses import dataclass

from specfork.errors import SpecforkError


@dataclass(frozen=True, slots=True)
class DataSettings:
    num_prompts: int = 1536
    code_fraction: float = 0.5
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    shard_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise SpecforkError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not 0.0 <= self.code_fraction <= 1.0:
            raise SpecforkError(f"code_fraction must be in [0, 1], got {self.code_fraction}")
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1 or self.shard_size < 1:
            raise SpecforkError("max_new_tokens, max_prompt_tokens and shard_size must be >= 1")


@dataclass(frozen=True, slots=True)
class DraftArch:
    hidden_size: int = 256
    num_layers: int = 4
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 2

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecforkError(f"draft {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise SpecforkError(f"hidden_size ({self.hidden_size}) must be a multiple of num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise SpecforkError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise SpecforkError("hidden_size / num_heads (the head size) must be even for rotary embeddings")


@dataclass(frozen=True, slots=True)
class TrainSettings:
    epochs: float = 4.0
    batch_tokens: int = 4096
    max_seq_len: int = 640
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.epochs > 0:
            raise SpecforkError(f"epochs must be > 0, got {self.epochs}")
        if self.batch_tokens < self.max_seq_len:
            raise SpecforkError(f"batch_tokens ({self.batch_tokens}) must be >= max_seq_len ({self.max_seq_len})")
        if self.max_seq_len < 16:
            raise SpecforkError(f"max_seq_len must be >= 16, got {self.max_seq_len}")
        if not self.lr > 0:
            raise SpecforkError(f"lr must be > 0, got {self.lr}")
        if self.checkpoint_every < 1:
            raise SpecforkError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
