"""The ``Step`` protocol: how one scheduled batch turns into new tokens. The engine drives a
step without knowing whether it is autoregressive or speculative."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specfork.engine.logprobs import logprob_entries
from specfork.engine.model_runner import ModelRunner
from specfork.engine.scheduler import ScheduledBatch
from specfork.engine.sequence import Sequence
from specfork.layers.sampler import logits_to_probs, sample_from_probs
from specfork.outputs import TokenLogprob


@dataclass(slots=True)
class NewTokens:
    """What a step produced for one sequence: its new tokens and, when the request asked for
    them, their log-probabilities under the target (one per token)."""

    ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class StepHealth:
    """How a step's helpers are doing (today: the SSD drafter process).

    ``degraded`` says why the step runs below its configured mode (None when it does not);
    the counters only grow."""

    degraded: str | None = None
    drafter_failures: int = 0
    drafter_restarts: int = 0


class Step(Protocol):
    lookahead: int  # extra KV slots a decode step needs per sequence beyond the next token

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, NewTokens]:
        """Run the batch; return the new tokens of every sequence that produced some."""
        ...

    def committed(self, seq: Sequence) -> None:
        """The engine appended the tokens of this step to ``seq`` (possibly fewer, at a stop)."""
        ...

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: free any state the step holds for it."""
        ...


def sampling_tensors(seqs: list[Sequence], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top-k and top-p (greedy rows get temperature 1; callers argmax them)."""
    temp = torch.tensor([s.params.temperature or 1.0 for s in seqs], dtype=torch.float32, device=device)
    top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long, device=device)
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
    return temp, top_k, top_p


def sample_with_probs(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int], list[int], torch.Tensor | None]:
    """One token per row of ``logits`` [N, V]: argmax for greedy requests, otherwise a draw from
    the filtered distribution with the request's own generator. Also returns which rows were
    sampled and the distributions they were drawn from ([len(sampled), V], or None)."""
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    probs = None
    if sampled:
        rows = [seqs[i] for i in sampled]
        idx = torch.tensor(sampled, device=logits.device)
        probs = logits_to_probs(logits.index_select(0, idx), *sampling_tensors(rows, logits.device))
        tokens[idx] = sample_from_probs(probs, [s.generator for s in rows])
    return tokens.tolist(), sampled, probs


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    return sample_with_probs(logits, seqs)[0]


def sample_new_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> dict[Sequence, NewTokens]:
    """One token per row of ``logits`` [N, V] (row i belongs to ``seqs[i]``), with its
    log-probability for the requests that asked for it."""
    tokens = sample_tokens(logits, seqs)
    return {s: NewTokens([t], _logprobs(logits, i, t, s)) for i, (s, t) in enumerate(zip(seqs, tokens, strict=True))}


def _logprobs(logits: torch.Tensor, row: int, token: int, seq: Sequence) -> list[TokenLogprob] | None:
    if seq.params.logprobs is None:
        return None
    return logprob_entries(logits[row : row + 1], [token], seq.params.logprobs)


class AutoregressiveStep:
    """Plain decoding: one forward pass, one new token per sequence."""

    lookahead = 0

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, NewTokens]:
        logits = self.runner.run_batch(batch)
        sampling = [s for s, samples in zip(batch.seqs, batch.samples, strict=True) if samples]
        if not sampling:
            return {}
        return sample_new_tokens(logits, sampling)

    def committed(self, seq: Sequence) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass
