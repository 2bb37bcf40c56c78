"""The engine configuration: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from specfork.errors import SpecforkError
from specfork.fanout import parse_fanout, uniform_fanout

DEFAULT_MODEL = "smollm2-135m"
MODES = ("ar", "sd", "ssd")
SSD_BACKUPS = ("jit", "fast")
TREE_BACKENDS = ("sdpa", "fast")
DRAFTERS = ("draft", "ngram")
WEIGHTS = ("native", "fp32")
QUANTIZE = ("int4",)
QUANTIZE_GROUPS = (32, 64, 128)
K_MAX = 8  # the most tokens k "auto" may propose in a round


@dataclass(frozen=True, slots=True)
class Config:
    """Everything that decides how an engine is built.

    model: an alias (``smollm2-135m``), an HF model directory, or a ``.gguf`` file.
    num_kv_blocks: KV-cache blocks of ``block_size`` tokens; None sizes the cache from
        ``kv_cache_tokens`` (enough for that many tokens in total).
    max_model_len: longest prompt + output; None takes the model's context length.
    threads: torch intra-op threads on CPU; None keeps torch's default.
    mode: "ar" (autoregressive), "sd" (speculative decoding) or "ssd" (speculative speculative
        decoding: the draft model runs in its own process on its own cores or device and
        pre-drafts the next round while the target verifies).
    drafter: in SD, "draft" (a draft model, ``draft``) or "ngram" (prompt lookup, n-grams of
        ``ngram_min``..``ngram_max`` tokens).
    draft: the draft checkpoint; None or "default" takes the draft shipped with specfork for
        the target (there is one for the embedded model).
    k: tokens proposed per speculative round, or "auto" (SD only): chosen from the measured draft
        and target step times and the acceptance observed so far (``speculative/auto_k.py``).
    fan_out: SSD branches pre-drafted per verification outcome (uniform F).
    fan_out_list / fan_out_list_miss: per-outcome fan-out (k + 1 entries, or "geometric:TOTAL" for
        the paper's capped-geometric allocation) for rounds that hit / missed the cache; they
        override fan_out; the miss list defaults to the hit list and must have the same total.
    backup: on an SSD cache miss, "jit" (draft now) or "fast" (n-gram guess, no draft compute).
    saguaro_x: Saguaro sampling coefficient C in (0, 1] (None: off), temperature > 0 only.
    tree_backend: SSD tree decode attention, "sdpa" (reference, explicit mask) or "fast"
        (per-branch block tables, the native paged kernel).
    drafter_device: the SSD drafter's device (default: the next GPU on CUDA, the CPU otherwise).
    target_cores / draft_cores: CPU core ids ("0", "0-3") for the two SSD processes; by default
        the available cores are split in two halves.
    drafter_timeout_s: an SSD drafter that does not answer within this many seconds is declared
        failed (requests go on in-process while it restarts); None (default) follows the observed
        round times instead (``speculative/ssd/deadline.py``: 10x the expected answer, 2 to 60 s).
    deterministic: batch-invariant kernels, so that speculative greedy output is bit-identical
        to AR greedy output (the default fast mode may differ at numerical near-ties).
    weights: "native" runs a GGUF's Q4_0/Q4_1/Q8_0 matrices in their quantised form (native
        kernel, CPU float32); "fp32" dequantises them at load. Target and draft alike.
    quantize: "int4" quantises an HF checkpoint's projections at load (groups of
        ``quantize_group`` = 32, 64 or 128 inputs) for the same kernel; None keeps float32.
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
    k: int | str = 5
    ngram_min: int = 1
    ngram_max: int = 4
    deterministic: bool = False
    fan_out: int = 3
    fan_out_list: str | list[int] | None = None
    fan_out_list_miss: str | list[int] | None = None
    backup: str = "jit"
    saguaro_x: float | None = None
    tree_backend: str = "fast"
    drafter_device: str | None = None
    target_cores: str | None = None
    draft_cores: str | None = None
    drafter_timeout_s: float | None = None
    weights: str = "native"
    quantize: str | None = None
    quantize_group: int = 32

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise SpecforkError("model must be a non-empty string (an alias, an HF directory or a .gguf file)")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise SpecforkError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise SpecforkError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device == "cpu" and self.dtype not in (None, "float32"):
            raise SpecforkError(f"dtype {self.dtype} is not supported on CPU; use float32")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise SpecforkError(f"seed must be an integer, got {self.seed!r}")
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
        if self.k == "auto":
            if self.mode == "ssd":
                raise SpecforkError("k 'auto' is for SD; SSD's k also shapes the drafter's tree: set it, "
                                    "e.g. from `specfork bench --sweep k=2,3,5`")
        else:
            _positive("k", self.k)
        if self.k_max > 32:
            raise SpecforkError(f"k must be at most 32, got {self.k}")
        _positive("ngram_min", self.ngram_min)
        _positive("ngram_max", self.ngram_max)
        if self.ngram_min > self.ngram_max:
            raise SpecforkError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if self.draft is not None and (not isinstance(self.draft, str) or not self.draft):
            raise SpecforkError("draft must be a non-empty path or alias")
        if not isinstance(self.deterministic, bool):
            raise SpecforkError(f"deterministic must be True or False, got {self.deterministic!r}")
        if self.backup not in SSD_BACKUPS:
            raise SpecforkError(f"backup must be one of {', '.join(SSD_BACKUPS)}, got {self.backup!r}")
        _positive("fan_out", self.fan_out)
        if self.tree_backend not in TREE_BACKENDS:
            raise SpecforkError(f"tree_backend must be one of {', '.join(TREE_BACKENDS)}, got {self.tree_backend!r}")
        hit, miss = self.fan_out_lists
        if sum(miss) != sum(hit):
            raise SpecforkError(f"fan_out_list_miss {list(miss)} must have the same total as the hit list {list(hit)}")
        if self.saguaro_x is not None and (
            not isinstance(self.saguaro_x, (int, float)) or isinstance(self.saguaro_x, bool)
            or not 0.0 < self.saguaro_x <= 1.0
        ):
            raise SpecforkError(f"saguaro_x (the Saguaro sampling coefficient C) must be in (0, 1], got {self.saguaro_x!r}")
        if self.drafter_device is not None and self.drafter_device.split(":")[0] not in ("cpu", "cuda"):
            raise SpecforkError(f"drafter_device must be 'cpu' or 'cuda[:N]', got {self.drafter_device!r}")
        for name in ("target_cores", "draft_cores"):
            if getattr(self, name) is not None:
                parse_cores(getattr(self, name), name)
        if self.drafter_timeout_s is not None and (
            not isinstance(self.drafter_timeout_s, (int, float)) or isinstance(self.drafter_timeout_s, bool)
            or not self.drafter_timeout_s > 0
        ):
            raise SpecforkError(f"drafter_timeout_s must be > 0 or None (adaptive), got {self.drafter_timeout_s!r}")
        if self.weights not in WEIGHTS:
            raise SpecforkError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise SpecforkError(f"quantize must be one of {', '.join(QUANTIZE)} or None, got {self.quantize!r}")
        if self.quantize_group not in QUANTIZE_GROUPS:
            raise SpecforkError(f"quantize_group must be one of {QUANTIZE_GROUPS}, got {self.quantize_group!r}")

    @property
    def load_options(self) -> dict:
        """How checkpoints are turned into weights (target and draft)."""
        return {"weights": self.weights, "quantize_group": self.quantize_group if self.quantize else None}

    @property
    def fan_out_lists(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(F for rounds that hit, F for rounds that missed), k + 1 entries each."""
        hit = self.fan_out_list
        hit = tuple(parse_fanout(hit, self.k_max) if hit is not None else uniform_fanout(self.k_max, self.fan_out))
        miss = self.fan_out_list_miss
        return hit, (tuple(parse_fanout(miss, self.k_max)) if miss is not None else hit)

    @property
    def auto_k(self) -> bool:
        return self.k == "auto"

    @property
    def k_max(self) -> int:
        """The most tokens a round may propose."""
        return K_MAX if self.auto_k else self.k

    @property
    def lookahead(self) -> int:
        """KV slots a decode step writes beyond the next token."""
        return 0 if self.mode == "ar" else self.k_max

    @property
    def torch_dtype_name(self) -> str:
        return self.dtype or "float32"


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecforkError(f"{name} must be an integer >= 1, got {value!r}")


def parse_cores(spec: str, name: str = "cores") -> tuple[int, ...]:
    """CPU core ids from "0", "0,2" or "0-3"."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part:
                lo, hi = part.split("-")
                cores.extend(range(int(lo), int(hi) + 1))
            else:
                cores.append(int(part))
    except ValueError:
        raise SpecforkError(f"{name} must look like 0 or 0,2 or 0-3, got {spec!r}") from None
    if not cores or any(c < 0 for c in cores):
        raise SpecforkError(f"{name} must name at least one core id >= 0, got {spec!r}")
    return tuple(dict.fromkeys(cores))
