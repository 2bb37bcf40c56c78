"""Prompt-lookup drafting: find the most recent earlier occurrence of the last n tokens in the
prompt and output so far, and propose the tokens that followed it. No model needed."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specfork.engine.sequence import Sequence
from specfork.speculative.proposer import Proposal, StatelessProposer


def ngram_lookup(tokens: list[int], *, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the longest suffix n-gram
    (n from ``max_n`` down to ``min_n``).

    Example: tokens [1, 2, 3, 9, 1, 2], n = 2 matches [1, 2] at 0 and proposes [3, 9, 1].
    """
    if k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        windows = sliding_window_view(arr[: length - 1], n)  # starts 0 .. length - 1 - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer(StatelessProposer):
    def __init__(self, *, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        tokens = [
            ngram_lookup(s.token_ids, min_n=self.min_n, max_n=self.max_n, k=k)
            for s, k in zip(seqs, num_tokens, strict=True)
        ]
        return Proposal(tokens, None)
