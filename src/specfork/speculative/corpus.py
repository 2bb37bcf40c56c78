"""Corpus lookup: prompt lookup's second source. Where the context's last n tokens (n = 8, 6, 4, 3,
longest first) occur in a corpus of the target's own earlier responses, propose the tokens that
followed them there.

Why: the target says the same things in the same words across requests (code idioms, phrasings of
its answers), so a context that matched one of its responses to the training prompts is often
continued the same way. The corpus is written by ``train-draft`` from the target's greedy
responses to ShareGPT's train split (``save_corpus``), never from evaluation prompts.

The index: for each n, a 32-bit hash of the n tokens before every corpus position, sorted
(numpy), so a lookup is a binary search; a hash match is confirmed against the tokens themselves,
so a collision never proposes a wrong continuation. Proposals depend on the context alone, so
they are deterministic like prompt lookup's, and verification keeps SD exact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specfork.errors import SpecforkError

NGRAM_LENGTHS = (8, 6, 4, 3)  # matched longest first
SEPARATOR = -1  # between two sequences of the corpus: no n-gram and no proposal crosses it
MAX_CANDIDATES = 8  # hash matches checked per n before giving up on that n
_MULTIPLIER_INT = 0x9E3779B97F4A7C15
_MULTIPLIER = np.uint64(_MULTIPLIER_INT)
_MASK64 = (1 << 64) - 1


def _hash_windows(tokens: np.ndarray, lengths: tuple[int, ...]) -> dict[int, np.ndarray]:
    """For each n in ``lengths`` (each at most len(tokens)): [len(tokens) - n + 1] uint32, the hash
    of tokens[i : i + n] for every i. The hash of a window's first j tokens is a step on the way
    to its first j + 1, so one pass of max(lengths) steps hashes every length."""
    hashes, h = {}, np.zeros(len(tokens) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(1, max(lengths) + 1):
            count = len(tokens) - j + 1  # windows of j tokens
            h = (h[:count] ^ tokens[j - 1 : j - 1 + count].astype(np.uint64)) * _MULTIPLIER
            if j in lengths:
                hashes[j] = (h >> np.uint64(32)).astype(np.uint32)
    return hashes


def _hash_window(tokens: list[int]) -> int:
    """``_hash_windows`` of one window of non-negative ids, in Python integers: a lookup hashes
    four short windows, where numpy's per-call cost was most of a lookup's time."""
    h = 0
    for t in tokens:
        h = ((h ^ int(t)) * _MULTIPLIER_INT) & _MASK64
    return h >> 32


def _stable_argsort(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of uint32 keys, as two stable sorts of their 16-bit
    halves, low half first: numpy sorts 16-bit integers stably by radix, in linear time, where a
    stable sort of 32-bit ones is a merge sort (the shipped corpus's four sorts: 0.65 s that way,
    0.36 s this way)."""
    by_low = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    return by_low[np.argsort((keys[by_low] >> 16).astype(np.uint16), kind="stable")]


class LookupCorpus:
    """``tokens``: int32, sequences separated by ``SEPARATOR``."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # separators[i]: the separators among tokens[:i]
        separators = np.concatenate([[0], np.cumsum(self.tokens == SEPARATOR, dtype=np.int32)])
        size = len(self.tokens)
        lengths = tuple(n for n in NGRAM_LENGTHS if n < size)
        window_hashes = _hash_windows(self.tokens[:-1], lengths) if lengths else {}
        for n in lengths:
            # The window tokens[end - n : end] and its next token tokens[end], for end in n..size - 1,
            # hold no separator.
            usable = separators[n + 1 : size + 1] == separators[: size - n]
            hashes = window_hashes[n][usable]
            ends = np.flatnonzero(usable).astype(np.int32) + np.int32(n)
            order = _stable_argsort(hashes)  # equal hashes keep corpus order
            self.index[n] = (hashes[order], ends[order])

    def __len__(self) -> int:
        return int(np.count_nonzero(self.tokens != SEPARATOR))

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the first corpus occurrence of the context's longest
        matching suffix n-gram (n in ``NGRAM_LENGTHS``); [] when none matches.

        Example: corpus [5, 6, 7, 8, 9], context [.., 6, 7, 8], k = 2 -> [9] (n = 3; the corpus ends)."""
        if k <= 0:
            return []
        for n, (hashes, ends) in self.index.items():
            if len(context) < n:
                continue
            suffix = context[-n:]
            h = np.uint32(_hash_window(suffix))
            lo = int(hashes.searchsorted(h, side="left"))
            hi = min(int(hashes.searchsorted(h, side="right")), lo + MAX_CANDIDATES)
            for end in ends[lo:hi].tolist():
                if self.tokens[end - n : end].tolist() == suffix:
                    follow = self.tokens[end : end + k].tolist()
                    return follow[: follow.index(SEPARATOR)] if SEPARATOR in follow else follow
        return []


def save_corpus(path: Path, sequences: list[list[int]], vocab_size: int) -> int:
    """Write ``sequences`` (token ids) as a corpus file; returns its token count."""
    parts = []
    for seq in sequences:
        if seq:
            parts.extend((np.asarray(seq, dtype=np.int32), np.array([SEPARATOR], dtype=np.int32)))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, tokens=tokens, vocab_size=np.int64(vocab_size))
    tmp.replace(path)
    return int(np.count_nonzero(tokens != SEPARATOR))


def load_corpus(path: Path, vocab_size: int) -> LookupCorpus:
    """The corpus in ``path``, refused unless it was written for a vocabulary of ``vocab_size``."""
    return LookupCorpus(read_corpus_tokens(path, vocab_size))


def read_corpus_tokens(path: Path, vocab_size: int) -> np.ndarray:
    """The int32 tokens of the corpus file ``path`` (sequences separated by ``SEPARATOR``), refused
    unless it was written for a vocabulary of ``vocab_size``."""
    try:
        with np.load(path, allow_pickle=False) as data:
            tokens, saved_vocab = data["tokens"], int(data["vocab_size"])
    except FileNotFoundError:
        raise SpecforkError(f"the lookup corpus {path} does not exist") from None
    except (OSError, KeyError, ValueError, AttributeError, TypeError):
        raise SpecforkError(f"{path} is not a lookup corpus (an .npz file with tokens and vocab_size, as "
                            "train-draft writes WORK_DIR/lookup_corpus.npz)") from None
    if saved_vocab != vocab_size:
        raise SpecforkError(f"the lookup corpus {path} was written for a vocabulary of {saved_vocab} tokens; "
                            f"the target has {vocab_size}")
    return tokens
