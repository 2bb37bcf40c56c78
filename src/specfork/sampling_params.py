"""Per-request sampling settings, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from specfork.errors import SpecforkError
from specfork.options import option

# The seeds a torch.Generator accepts: any 64-bit pattern, written signed or unsigned.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20  # most alternatives reported per position (as OpenAI's top_logprobs)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature == 0 means greedy decoding; top_k == 0 and top_p == 1.0 disable those filters.
    A request with ``seed`` set produces the same tokens whatever else shares its batch.

    ``logprobs`` (None: off) asks for the target model's log-probability of every generated
    token plus that many most likely alternatives per position; ``prompt_logprobs`` the same for
    the prompt's tokens (from the second on). Both are of the model's own distribution (the
    log-softmax of its logits, before temperature, top-k or top-p), in every decoding mode.
    """

    temperature: float = option(1.0, "0 = greedy")
    top_p: float = option(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    top_k: int = option(0, "keep the k most likely tokens; 0 = off")
    max_tokens: int = option(16, "tokens to generate at most")
    seed: int | None = option(None, cli=False)  # per request (the API's seed); the command line seeds the engine
    ignore_eos: bool = option(False, "keep generating after EOS (fixed-length outputs)")
    stop: tuple[str, ...] = option(default_factory=tuple, help="stop string (repeatable)", repeat=True)
    stop_token_ids: tuple[int, ...] = option(default_factory=tuple, cli=False)
    logprobs: int | None = option(None, cli=False)
    prompt_logprobs: int | None = option(None, cli=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:  # NaN too
            raise SpecforkError(f"temperature must be a number >= 0, got {self.temperature!r}", param="temperature")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise SpecforkError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise SpecforkError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", param="top_k")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise SpecforkError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise SpecforkError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}", param="seed")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise SpecforkError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}", param=name)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SpecforkError(f"stop must be non-empty strings, got {self.stop!r}", param="stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise SpecforkError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}", param="stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choice_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th of several samples drawn for one request with ``seed``: the
    seed itself for the first, a 64-bit mix of (seed, index) for the others (splitmix64), so the
    samples are reproducible and independent of one another."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)
