"""The engine configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from specfork.errors import SpecforkError

DEFAULT_MODEL = "smollm2-135m"
MODES = ("ar", "sd")
DRAFTERS = ("draft", "ngram")


@dataclass(frozen=True, slots=True)
class Config:
    """Everything that decides how an engine is built.

    model: an alias (``smollm2-135m``), an HF model directory, or a ``.gguf`` file.
    num_kv_blocks: KV-cache blocks of ``block_size`` tokens; None sizes the cache from
        ``kv_cache_tokens`` (enough for that many tokens in total).
    max_model_len: longest prompt + output; None takes the model's context length.
    threads: torch intra-op threads on CPU; None keeps torch's default.
    mode: "ar" (autoregressive) or "sd" (speculative decoding).
    drafter: in SD, "draft" (a draft model, ``draft``) or "ngram" (prompt lookup, n-grams of
        ``ngram_min``..``ngram_max`` tokens).
    k: tokens proposed per speculative round.
    deterministic: batch-invariant kernels, so that speculative greedy output is bit-identical
        to AR greedy output (the default fast mode may differ at numerical near-ties).
    """

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_tokens: int = 16384
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    threads: int | None = None
    seed: int = 0
    mode: str = "ar"
    drafter: str = "draft"
    draft: str | None = None
    k: int = 5
    ngram_min: int = 1
    ngram_max: int = 4
    deterministic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecforkError("model must be a non-empty string (an alias, an HF directory or a .gguf file)")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise SpecforkError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise SpecforkError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device == "cpu" and self.dtype not in (None, "float32"):
            raise SpecforkError(f"dtype {self.dtype} is not supported on CPU; use float32")
        _positive("block_size", self.block_size)
        _positive("kv_cache_tokens", self.kv_cache_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.threads is not None:
            _positive("threads", self.threads)
        if self.mode not in MODES:
            raise SpecforkError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.drafter not in DRAFTERS:
            raise SpecforkError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        _positive("k", self.k)
        if self.k > 32:
            raise SpecforkError(f"k must be at most 32, got {self.k}")
        _positive("ngram_min", self.ngram_min)
        _positive("ngram_max", self.ngram_max)
        if self.ngram_min > self.ngram_max:
            raise SpecforkError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft):
            raise SpecforkError("draft must be a non-empty path or alias")
        if not isinstance(self.deterministic, bool):
            raise SpecforkError(f"deterministic must be True or False, got {self.deterministic!r}")

    @property
    def lookahead(self) -> int:
        """KV slots a decode step writes beyond the next token."""
        return 0 if self.mode == "ar" else self.k

    @property
    def torch_dtype_name(self) -> str:
        return self.dtype or "float32"


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecforkError(f"{name} must be an integer >= 1, got {value!r}")
