"""The ``Step`` protocol: how one scheduled batch turns into new tokens. The engine drives a
step without knowing whether it is autoregressive or speculative."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specfork.engine.logprobs import logprob_entries
from specfork.engine.model_runner import ModelRunner
from specfork.engine.scheduler import PrefixUser, ScheduledBatch
from specfork.engine.sequence import Sequence
from specfork.outputs import TokenLogprob
from specfork.sampling import adjust_logits_, sample_tokens, step_draws


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


class Step(PrefixUser, Protocol):
    """A decoding step; as the scheduler's ``PrefixUser`` it says how much of a prompt's cached
    prefix a sequence may start from (its helpers may need their own state for it)."""

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

    def health(self) -> StepHealth:
        """How the step's helpers are doing."""
        ...

    def idle(self) -> None:
        """Nothing to run: look after the step's helpers (a dead SSD drafter noticed and
        restarted while no request asks for drafts)."""
        ...

    def close(self) -> None:
        """Release what the step holds outside this process (e.g. a drafter process); idempotent."""
        ...


def sample_new_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> dict[Sequence, NewTokens]:
    """One token per row of ``logits`` [N, V] (row i belongs to ``seqs[i]``), drawn after the
    requests' logit adjustments (made in place), with its log-probability (of the model's own
    logits) for the requests that asked for it."""
    raw = adjust_logits_(logits, [s.history() for s in seqs])
    tokens = sample_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
    return {s: NewTokens([t], _logprobs(raw.get(i, logits[i : i + 1]), t, s))
            for i, (s, t) in enumerate(zip(seqs, tokens, strict=True))}


def _logprobs(row: torch.Tensor, token: int, seq: Sequence) -> list[TokenLogprob] | None:
    if seq.params.logprobs is None:
        return None
    return logprob_entries(row, [token], seq.params.logprobs)


def decode_steps_for(batch: ScheduledBatch, limit: int, runner: ModelRunner, max_model_len: int | None) -> int:
    """How many decode steps ``batch`` runs in one native call (at most ``limit``): 1 unless it is a
    decode batch whose requests adjust their logits, if at all, in ways the call takes along
    (penalties, logit bias, min_p, min_tokens: not a grammar, allowed ids or bad words), and the
    runner can (log-probabilities come back with the tokens); never past a
    request's max_tokens or the model's length (a request that stops earlier, at EOS or a stop
    string, takes the tokens up to it and the rest are dropped, as a speculative round's are)."""
    if limit == 1 or batch.is_prefill or any(n != 1 for n in batch.num_new_tokens):
        return 1
    if not runner.decodes_in_one_call:  # the one-call path taken away since (a benchmark's module path)
        return 1
    steps = limit
    for seq in batch.seqs:
        params = seq.params
        if seq.history().adjusts_in_python:
            return 1
        steps = min(steps, params.max_tokens - seq.num_output_tokens)
        if max_model_len is not None:
            steps = min(steps, max_model_len - len(seq))
    return max(steps, 1)


def run_decode_steps(runner: ModelRunner, seqs: list[Sequence], steps: int) -> dict[Sequence, NewTokens]:
    """``steps`` tokens for each of ``seqs`` from one native call (``decode_steps_for`` allowed it),
    each sampled request's draws taken from its generator as that many steps would take them, each
    request's logit adjustments made at every step as ``adjust_logits_`` makes them, and its
    log-probabilities taken as one step a call takes them where it asks."""
    draws = step_draws([s.params for s in seqs], [s.generator for s in seqs], steps, runner.device,
                       [s.history() for s in seqs])
    tokens, logprobs = runner.decode_steps(seqs, steps, draws)
    return {s: NewTokens(ids, lps) for s, ids, lps in zip(seqs, tokens, logprobs, strict=True)}


class AutoregressiveStep:
    """Plain decoding: one forward pass, one new token per sequence; or, where the runner can and
    no sequence of a decode batch has logits to adjust in Python (``decode_steps_for``), up to
    ``decode_steps`` decode steps back to back in one native call, each sequence taking their tokens
    (the same tokens, greedy or drawn with the request's generator, without Python between the
    steps: ``ModelRunner.decode_steps``)."""

    def __init__(self, runner: ModelRunner, decode_steps: int = 1, max_model_len: int | None = None) -> None:
        self.runner = runner
        self.decode_steps = decode_steps if runner.decodes_in_one_call else 1
        self.lookahead = self.decode_steps - 1  # KV slots a decode step may write past the next token
        self.max_model_len = max_model_len

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, NewTokens]:
        steps = decode_steps_for(batch, self.decode_steps, self.runner, self.max_model_len)
        if steps > 1:
            return run_decode_steps(self.runner, batch.seqs, steps)
        logits = self.runner.run_batch(batch)
        sampling = [s for s, samples in zip(batch.seqs, batch.samples, strict=True) if samples]
        if not sampling:
            return {}
        return sample_new_tokens(logits, sampling)

    def committed(self, seq: Sequence) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        return num_tokens

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def health(self) -> StepHealth:
        return StepHealth()

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass
