"""Prompt-lookup drafting: find the most recent earlier occurrence of the last n tokens in the
prompt and output so far, and propose the tokens that followed it; where there is none, look the
last tokens up in a corpus of the target's earlier responses, if one is loaded
(:mod:`specfork.speculative.corpus`). No model needed."""

from __future__ import annotations

from specfork.config import DEFAULT_CORPUS_TOKENS
from specfork.engine.sequence import Sequence
from specfork.speculative.corpus import LookupCorpus
from specfork.speculative.proposer import Proposal, ReadsNoFeatures


def ngram_lookup(tokens: list[int], *, min_n: int, max_n: int, k: int) -> list[int]:
    """``k`` tokens that followed the latest earlier match of the longest suffix n-gram (n from
    ``max_n`` down to ``min_n``). Where they run into the context's end, the copy goes on from
    its own start: a match that close means the context repeats with the period between the
    match and the suffix (``()()()``, a run of one token), and the copy continues the repetition.

    Examples: tokens [1, 2, 3, 9, 1, 2], n = 2 matches [1, 2] at 0 and proposes [3, 9, 1] for
    k = 3, [3, 9, 1, 2, 3] for k = 5; tokens [5, 6, 5, 6] propose [5, 6, 5] for k = 3.

    One lookup in a context seen once; a context that grows from round to round keeps its
    :class:`NgramIndex` instead.
    """
    return NgramIndex(min_n=min_n, max_n=max_n).propose(tokens, k)


def _follow(tokens: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start`` on, the copy going on from its own start past the context's end."""
    found = [int(t) for t in tokens[start : start + k]]
    period = len(tokens) - start  # the tokens from the match to the context's end: all of found if short
    return found + [found[i % period] for i in range(len(found), k)]


class NgramIndex:
    """Prompt lookup (:func:`ngram_lookup`) over one growing context at the cost of its new
    tokens: the latest end of every n-gram (``min_n`` <= n <= ``max_n``) that ends before the
    context's last token, kept from call to call.

    Each call must pass the previous call's context, extended (a sequence's tokens only grow).
    A lookup is then a few dictionary reads, where scanning the context took ~80 us per round
    at 500 tokens in the SD loop (numpy, on the caches a forward pass has just flushed)."""

    def __init__(self, *, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # the n-grams ending before this position are in _latest

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """What ``ngram_lookup(tokens, min_n=min_n, max_n=max_n, k=k)`` proposes."""
        length = len(tokens)
        if k <= 0 or length < 2:
            return []
        if length - 1 < self._indexed:
            raise ValueError("NgramIndex: the context is shorter than the one indexed before")
        latest = self._latest
        for end in range(self._indexed, length - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                latest[tuple(tokens[end - n + 1 : end + 1])] = end
        self._indexed = length - 1
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = latest.get(tuple(tokens[length - n :]))
            if end is not None:
                return _follow(tokens, end + 1, k)
        return []


class PromptLookup:
    """Prompt lookup for the sequences of a batch: each sequence's :class:`NgramIndex`, and
    the corpus (if one is loaded) where the context has no match, for at most ``corpus_tokens``
    tokens (a corpus match is accepted far less often than one in the context, so a long
    proposal from it mostly buys verify rows)."""

    def __init__(self, *, min_n: int, max_n: int, corpus: LookupCorpus | None = None,
                 corpus_tokens: int = DEFAULT_CORPUS_TOKENS) -> None:
        self.min_n, self.max_n, self.corpus, self.corpus_tokens = min_n, max_n, corpus, corpus_tokens
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq: Sequence, k: int) -> tuple[list[int], str | None]:
        """(proposal, source): prompt lookup's proposal ("lookup"), else the corpus's
        ("corpus"), else ([], None)."""
        if k <= 0:
            return [], None
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = NgramIndex(min_n=self.min_n, max_n=self.max_n)
        found = index.propose(seq.token_ids, k)
        if found:
            return found, "lookup"
        if self.corpus is not None:
            found = self.corpus.propose(seq.token_ids, min(k, self.corpus_tokens))
            if found:
                return found, "corpus"
        return [], None

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)


class NgramProposer(ReadsNoFeatures):
    def __init__(self, *, min_n: int, max_n: int, corpus: LookupCorpus | None = None,
                 corpus_tokens: int = DEFAULT_CORPUS_TOKENS) -> None:
        self.lookup = PromptLookup(min_n=min_n, max_n=max_n, corpus=corpus, corpus_tokens=corpus_tokens)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        found = [self.lookup.propose(s, k) for s, k in zip(seqs, num_tokens, strict=True)]
        return Proposal([t for t, _ in found], None, [source for _, source in found])

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        self.lookup.release(seq)
