"""Per-request log-probabilities, computed from the target's logits by the one function in
``layers/logprobs`` (AR and speculative steps alike; prompt tokens at prefill)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specfork.engine.sequence import Sequence
from specfork.layers.logprobs import token_logprobs
from specfork.outputs import TokenLogprob

PROMPT_ROWS_PER_PASS = 64  # prompt positions turned into logits at a time (bounds memory)


def logprob_entries(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per row of ``logits`` [N, V]: the log-probability of ``tokens[i]`` and the
    ``top`` most likely tokens."""
    chosen, ids, values = token_logprobs(logits, torch.tensor(tokens, dtype=torch.long), top)
    return [
        TokenLogprob(tok, lp, tuple(zip(row_ids, row_values, strict=True)))
        for tok, lp, row_ids, row_values in zip(tokens, chosen.tolist(), ids.tolist(), values.tolist(), strict=True)
    ]


def record_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # [T, H] hidden states of every token computed in this prefill pass
    seqs: list[Sequence],
    starts: list[int],
    counts: list[int],
) -> None:
    """For each sequence that asked for prompt log-probabilities, append the entries of the
    prompt tokens this pass scores: the row at position p gives the log-probability of the token
    at p + 1. Chunked prefills add their part each pass; a recompute after preemption adds
    nothing twice."""
    offset = 0
    for seq, start, n in zip(seqs, starts, counts, strict=True):
        top = seq.params.prompt_logprobs
        if top is not None:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = []
            first = 1 + len(seq.prompt_logprobs)  # the next prompt token without an entry
            targets = range(max(first, start + 1), min(start + n, seq.num_prompt_tokens - 1) + 1)
            for lo in range(targets.start, targets.stop, PROMPT_ROWS_PER_PASS):
                hi = min(lo + PROMPT_ROWS_PER_PASS, targets.stop)
                rows = torch.arange(offset + lo - 1 - start, offset + hi - 1 - start, device=hidden.device)
                logits = compute_logits(hidden.index_select(0, rows))
                seq.prompt_logprobs.extend(logprob_entries(logits, seq.token_ids[lo:hi], top))
        offset += n
