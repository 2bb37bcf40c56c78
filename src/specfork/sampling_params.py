"""Per-request sampling settings, validated once at construction."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass

from specfork.errors import SpecforkError
from specfork.options import option

# The seeds a torch.Generator accepts: any 64-bit pattern, written signed or unsigned.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20  # most alternatives reported per position (as OpenAI's top_logprobs)
MAX_BAD_WORDS = 128  # as vLLM's GPU sampler
# Temperatures below this decode greedily, as vLLM's (its _SAMPLING_EPS): logits / t overflow float32
# for the smallest (1e-46 is 0 in float32, a division by zero), and what remains of the
# distribution above them is the argmax.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """What a request's output must be, as vLLM's structured outputs say it (exactly one of):
    text matching the JSON schema ``json`` (a dict, or its JSON text), any JSON object
    (``json_object``), text matching the regular expression ``regex``, or one of the strings of
    ``choice``. The engine holds the output to it by masking, in every row it samples or verifies,
    the tokens that could not continue it (``specfork.structured_output``)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        param = "structured_outputs"
        if self.json is not None:
            schema = self.json
            try:
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise SpecforkError(f"a JSON schema must be a JSON object, got {type(schema).__name__}",
                                        param=param)
                # As text (hashable), its keys in the order given: properties are generated in it.
                object.__setattr__(self, "json", json.dumps(schema))
            except (ValueError, TypeError, RecursionError) as e:  # not JSON, not serialisable, nested too deeply
                raise SpecforkError(f"the JSON schema is not JSON: {str(e) or type(e).__name__}", param=param) from None
        if not isinstance(self.json_object, bool):
            raise SpecforkError(f"json_object must be True or False, got {self.json_object!r}", param=param)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise SpecforkError(f"regex must be a non-empty string, got {self.regex!r}", param=param)
        if self.choice is not None:
            choice = tuple(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise SpecforkError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}",
                                    param=param)
            object.__setattr__(self, "choice", choice)
        given = [name for name in ("json", "json_object", "regex", "choice") if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SpecforkError(f"structured outputs take exactly one of json, json_object, regex and choice; got "
                                f"{', '.join(given) or 'none'}", param=param)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below GREEDY_BELOW, 1e-5) means greedy decoding; top_k == 0 and top_p == 1.0 disable those filters.
    A request with ``seed`` set produces the same tokens whatever else shares its batch.

    The logits are adjusted as vLLM's sampler adjusts them, in its order, before any filter:
    only ``allowed_token_ids`` (when given) may be drawn; ``bad_words`` hold back the last token of
    each word's tokens wherever the others precede it; ``min_tokens`` holds back EOS (unless
    ignored) and ``stop_token_ids``; ``logit_bias`` is added; ``repetition_penalty``
    (tokens of the prompt and output), ``frequency_penalty`` and ``presence_penalty`` (tokens of
    the output); then, after temperature, ``min_p``. Every decoding mode samples and verifies from
    the adjusted logits (``specfork.sampling.adjust_logits_``), so speculation stays exact.

    ``logprobs`` (None: off) asks for the target model's log-probability of every generated
    token plus that many most likely alternatives per position; ``prompt_logprobs`` the same for
    the prompt's tokens (from the second on). Both are of the model's own distribution (the
    log-softmax of its logits, before any adjustment, temperature, top-k or top-p), in every decoding mode.
    """

    temperature: float = option(1.0, "0 = greedy (as is any temperature below 1e-5)")
    top_p: float = option(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    top_k: int = option(0, "keep the k most likely tokens; 0 = off")
    min_p: float = option(0.0, "drop the tokens less likely than min_p x the most likely one; 0 = off")
    repetition_penalty: float = option(
        1.0, "divide the positive logits of tokens already in the prompt or output by this (multiply the "
        "negative ones); 1 = off")
    presence_penalty: float = option(0.0, "subtract this from the logit of every token already in the output "
                                     "(-2..2); 0 = off")
    frequency_penalty: float = option(0.0, "subtract this x its count in the output from each token's logit "
                                      "(-2..2); 0 = off")
    max_tokens: int = option(16, "tokens to generate at most")
    min_tokens: int = option(0, "tokens to generate before EOS, a stop token id or a stop string may end the output")
    seed: int | None = option(None, cli=False)  # per request (the API's seed); the command line seeds the engine
    ignore_eos: bool = option(False, "keep generating after EOS (fixed-length outputs)")
    stop: tuple[str, ...] = option(default_factory=tuple, help="stop string (repeatable)", repeat=True)
    bad_words: tuple[str, ...] = option(default_factory=tuple, help="a word never to generate: its last token is held "
                                        "back wherever the others precede (repeatable)", repeat=True)
    stop_token_ids: tuple[int, ...] = option(default_factory=tuple, cli=False)
    logit_bias: tuple[tuple[int, float], ...] = option(default_factory=tuple, cli=False)  # (id, bias): a dict too
    allowed_token_ids: tuple[int, ...] | None = option(None, cli=False)  # only these (None: all)
    include_stop_str_in_output: bool = option(False, cli=False)  # the stop string ends the text (vLLM's name)
    skip_special_tokens: bool = option(True, cli=False)  # special tokens (EOS, chat markup) left out of the text
    logprobs: int | None = option(None, cli=False)
    prompt_logprobs: int | None = option(None, cli=False)
    structured_outputs: StructuredOutputs | None = option(None, cli=False)  # the output's grammar (None: free)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _strings(self.stop, "stop", blank_ok=True))
        object.__setattr__(self, "bad_words", _strings(self.bad_words, "bad_words", blank_ok=False))
        if len(self.bad_words) > MAX_BAD_WORDS:  # every row of every step checks each
            raise SpecforkError(f"bad_words holds {len(self.bad_words)} words; at most {MAX_BAD_WORDS}",
                                param="bad_words")
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids"))
        if self.allowed_token_ids is not None:
            allowed = _token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise SpecforkError("allowed_token_ids must name at least one token (None allows them all)",
                                    param="allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        temperature = _real(self.temperature)
        if temperature is None or not 0 <= temperature < math.inf:  # NaN too
            raise SpecforkError(f"temperature must be a finite number >= 0, got {self.temperature!r}", param="temperature")
        top_p = _real(self.top_p)
        if top_p is None or not 0.0 < top_p <= 1.0:
            raise SpecforkError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        top_k = _integer(self.top_k)
        if top_k is None or top_k < 0:
            raise SpecforkError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", param="top_k")
        max_tokens = _integer(self.max_tokens)
        if max_tokens is None or max_tokens < 1:
            raise SpecforkError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens")
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "max_tokens", max_tokens)
        min_tokens = _integer(self.min_tokens)
        if min_tokens is None or not 0 <= min_tokens <= max_tokens:
            raise SpecforkError(f"min_tokens must be an integer in [0, {max_tokens}] (at most the tokens the request "
                                f"may generate), got {self.min_tokens!r}", param="min_tokens")
        object.__setattr__(self, "min_tokens", min_tokens)
        ranges = {"min_p": ("in [0, 1]", lambda v: 0.0 <= v <= 1.0),
                  "repetition_penalty": ("finite and > 0", lambda v: 0.0 < v < math.inf),
                  "presence_penalty": ("in [-2, 2]", lambda v: -2.0 <= v <= 2.0),
                  "frequency_penalty": ("in [-2, 2]", lambda v: -2.0 <= v <= 2.0)}
        for name, (allowed, within) in ranges.items():
            value = _real(getattr(self, name))
            if value is None or not within(value):  # NaN too
                raise SpecforkError(f"{name} must be {allowed}, got {getattr(self, name)!r}", param=name)
            object.__setattr__(self, name, value)
        if self.seed is not None:
            seed = _integer(self.seed)
            if seed is None or not SEED_MIN <= seed <= SEED_MAX:
                raise SpecforkError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {self.seed!r}",
                                    param="seed")
            object.__setattr__(self, "seed", seed)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SpecforkError(f"{name} must be True or False, got {getattr(self, name)!r}", param=name)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                count = _integer(value)
                if count is None or not 0 <= count <= MAX_LOGPROBS:
                    raise SpecforkError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}",
                                        param=name)
                object.__setattr__(self, name, count)
        if self.structured_outputs is not None:
            self._check_structured_outputs()

    def _check_structured_outputs(self) -> None:
        """A grammar's mask leaves the tokens that continue the output; the settings that hold
        tokens back too could leave none (EOS alone once the output is complete), and ignore_eos
        would generate past its end: refused together."""
        if not isinstance(self.structured_outputs, StructuredOutputs):
            raise SpecforkError(f"structured_outputs must be a StructuredOutputs, got "
                                f"{type(self.structured_outputs).__name__}", param="structured_outputs")
        clashes = {"ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens > 0,
                   "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words)}
        for name, clashes_here in clashes.items():
            if clashes_here:
                raise SpecforkError(f"{name} cannot be combined with structured outputs: the grammar decides which "
                                    "tokens may come and when the output ends", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        """Whether ``specfork.sampling.adjust_logits_`` changes this request's logits whatever its
        output so far (min_tokens aside: ``TokenHistory.adjusts`` decides it from the output; a
        structured output's grammar is the sequence's, and ``TokenHistory.adjusts`` counts it too)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or (self.min_p > 0.0 and not self.greedy) or bool(self.logit_bias) or bool(self.allowed_token_ids))


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


def _real(value: object) -> float | None:
    """``value`` as a float if it is a real number (numpy's too), not a bool; else None."""
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def _integer(value: object) -> int | None:
    """``value`` as an int if it is an integer (numpy's too), not a bool; else None."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def _strings(value: object, name: str, *, blank_ok: bool) -> tuple[str, ...]:
    """A string or a list of them, none empty, and none all whitespace unless ``blank_ok`` (a stop
    string may be "\\n"; a bad word may not be blank)."""
    if value is None:
        return ()
    strings = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if strings is None or any(not isinstance(s, str) or not (s if blank_ok else s.strip()) for s in strings):
        raise SpecforkError(f"{name} must be a non-empty string or a list of them, got {value!r}", param=name)
    return strings


def _token_ids(ids: object, name: str) -> tuple[int, ...]:
    if ids is None:
        return ()
    values = tuple(_integer(t) for t in ids) if isinstance(ids, (list, tuple)) else None
    if values is None or any(t is None or t < 0 for t in values):
        raise SpecforkError(f"{name} must be a list of integers >= 0, got {ids!r}", param=name)
    return values


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id, from a dict or pairs; ids may be written as decimal
    strings (JSON's object keys), biases in [-100, 100] as in OpenAI's API."""
    if not bias:
        return ()
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias) if isinstance(bias, (list, tuple)) else None
    if pairs is None:
        raise SpecforkError(f"logit_bias must map token ids to biases, got {type(bias).__name__}", param="logit_bias")
    out = {}
    for pair in pairs:
        key, value = pair if isinstance(pair, tuple | list) and len(pair) == 2 else (None, None)
        digits = isinstance(key, str) and key.isascii() and key.strip().isdecimal()
        token = int(key) if digits else None if isinstance(key, str) else _integer(key)
        amount = _real(value)
        if token is None or token < 0 or amount is None or not -100.0 <= amount <= 100.0:
            shown = repr(pair) if len(repr(pair)) <= 80 else repr(pair)[:77] + "..."
            raise SpecforkError(f"logit_bias must map token ids (integers >= 0) to biases in [-100, 100]; it holds "
                                f"{shown}", param="logit_bias")
        out[token] = amount
    return tuple(sorted(out.items()))
