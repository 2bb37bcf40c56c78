"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regular
expression or a list of choices (``SamplingParams.structured_outputs``, vLLM's guided decoding).

The grammar is compiled by llguidance (the Rust matcher vLLM also uses) against the model's
tokenizer. Each request keeps one matcher, advanced through its output tokens as they are
committed. For a row of logits the matcher says which tokens may come next, and every other token
is set to -inf, first among the logit adjustments (``specfork.sampling.adjust_logits_``). A verify
window's row j follows the drafts before it: the matcher takes them one at a time, gives each row
its mask, and is rolled back after the window. A draft the grammar refuses is itself masked in its
row, so verification rejects it, and the rows after it are never reached (they repeat its row's
mask). AR, SD and SSD therefore sample and verify from the same masked logits: greedy outputs stay
equal, and sampled ones keep the masked target distribution. Drafters draw without the mask (a
draft the grammar refuses is only a rejected draft). Once the output is complete the matcher
allows EOS alone."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from specfork.errors import SpecforkError
from specfork.sampling_params import StructuredOutputs

PARAM = "structured_outputs"
COMPILED_KEPT = 64  # grammars kept compiled (least recently used out first)


class GrammarCompiler:
    """Builds each request's matcher; the tokenizer's table for llguidance is made on first use
    (~0.4 s for a 49k vocabulary), so engines that never see a grammar pay nothing."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._unusable: SpecforkError | None = None  # why this model's tokenizer cannot serve grammars
        self._lock = threading.Lock()  # the server checks grammars off the engine thread
        # grammar text -> a matcher in its start state, copied for each request (a 40-property
        # schema takes ~1.5 ms to compile, a copy ~0.03 ms: a request's n choices, or a server's
        # repeated schema, compile once)
        self._compiled: OrderedDict[str, object] = OrderedDict()

    def check(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` once, for its errors (a server calls this while preparing a request,
        off the engine thread, so that the tokenizer's table is built and a grammar that does not
        compile is refused there rather than in the engine's loop)."""
        self.grammar(spec)

    def grammar(self, spec: StructuredOutputs) -> OutputGrammar:
        """A fresh matcher for ``spec``; a SpecforkError naming ``structured_outputs`` when the model
        has no usable tokenizer or the grammar does not compile (an unknown schema keyword, a bad
        regex)."""
        import llguidance

        text = _grammar_text(spec)
        with self._lock:
            compiled = self._compiled.get(text)
            if compiled is not None:
                self._compiled.move_to_end(text)
                return OutputGrammar(compiled.deep_copy(), self._vocab_size)
        matcher = llguidance.LLMatcher(self._llguidance_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise SpecforkError(f"the structured output does not compile: {matcher.get_error()}", param=PARAM)
        with self._lock:
            self._compiled[text] = matcher.deep_copy()
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return OutputGrammar(matcher, self._vocab_size)

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None and self._unusable is None:
                self._unusable = self._unusable_because()
                if self._unusable is None:
                    import llguidance.hf

                    try:
                        self._ll_tokenizer = llguidance.hf.from_tokenizer(
                            self._tokenizer.hf, n_vocab=self._vocab_size, eos_token=self._eos)
                    except Exception as e:  # a slow tokenizer, one with more tokens than the model, ...
                        self._unusable = SpecforkError(f"structured outputs cannot use this model's tokenizer: {e}",
                                                       param=PARAM)
            if self._unusable is not None:  # a new error each time (one raised again keeps its old traceback)
                raise SpecforkError(str(self._unusable), param=PARAM)
            return self._ll_tokenizer

    def _unusable_because(self) -> SpecforkError | None:
        if self._tokenizer is None:
            return SpecforkError("structured outputs need the model's tokenizer, and this model has none", param=PARAM)
        if not self._eos:
            return SpecforkError("structured outputs need an end-of-sequence token, and this model names none",
                                 param=PARAM)
        return None


def _grammar_text(spec: StructuredOutputs) -> str:
    """llguidance's grammar for ``spec``: a JSON schema (``json_object``: any object), a regular
    expression, or the alternation of the choices, each matched literally."""
    from llguidance import LLMatcher

    try:
        if spec.json is not None:
            return LLMatcher.grammar_from_json_schema(spec.json)
        if spec.json_object:
            return LLMatcher.grammar_from_json_schema('{"type": "object"}')
        if spec.regex is not None:
            return LLMatcher.grammar_from_regex(spec.regex)
        return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in spec.choice))
    except ValueError as e:  # llguidance refuses a malformed schema here
        raise SpecforkError(f"the structured output does not compile: {e}", param=PARAM) from None


class OutputGrammar:
    """One request's matcher, in step with its committed output tokens."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0  # output tokens the matcher has taken

    def mask_(self, rows: np.ndarray, output: Sequence[int], drafts: Sequence[int]) -> None:
        """Set to -inf, in place, every token the grammar does not allow in each of ``rows`` [n, V]:
        row j follows ``output`` and then ``drafts[:j]``."""
        self._catch_up(output)
        import llguidance.numpy

        n = rows.shape[0]
        bitmask = llguidance.numpy.allocate_token_bitmask(n, self.vocab_size)
        taken = 0
        try:
            for j in range(n):
                self._fill(bitmask, j)
                if j + 1 < n:
                    draft = int(drafts[j])
                    # Rows past a draft the mask refuses, or past the output's end (where EOS alone
                    # is allowed, and ends the sequence), are never reached. A refused token would
                    # leave the matcher in error, and a stopped one takes EOS without counting it.
                    if (self.matcher.is_stopped() or not 0 <= draft < self.vocab_size
                            or not (bitmask[j, draft >> 5] >> (draft & 31)) & 1):
                        bitmask[j + 1 :] = bitmask[j]
                        break
                    self._consume(draft, "draft")
                    taken += 1
        finally:
            if taken:
                self.matcher.rollback(taken)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : rows.shape[1]]
        rows[allowed == 0] = -np.inf

    def _catch_up(self, output: Sequence[int]) -> None:
        for token in output[self.consumed :]:
            self._consume(int(token), "token")
            self.consumed += 1

    def _consume(self, token: int, what: str) -> None:
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise RuntimeError(f"the output's grammar failed at {what} {token}: {self.matcher.get_error()}")

    def _fill(self, bitmask: np.ndarray, row: int) -> None:
        """The row's mask; a matcher in error (llguidance ran out of a resource limit) fails the
        step rather than leaving EOS alone allowed, which would end the output unfinished."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.matcher.is_error():
            raise RuntimeError(f"the output's grammar failed: {self.matcher.get_error()}")
