"""``--k auto``: choose the number of speculated tokens from measured costs and acceptance.

With a per-token acceptance probability a, a round that proposes k tokens yields
E(k) = (1 - a^(k+1)) / (1 - a) tokens per sequence (accepted ones plus the bonus). A round of B
sequences costs T(B, k) = k * t_draft(B) + t_forward(B * (k + 1)): every sequence's k + 1 rows go
through one target forward, so a round's cost depends on the rows of the whole batch, not on one
sequence's window (at batch 8 on a 2-core CPU a k = 1 round costs nearly twice a plain one; priced
as one sequence's 2-row window, k auto speculated there and lost to AR). t_forward is measured once
on this machine when the engine is built, for windows of 1..K_MAX + 1 rows and of 16, 32 and 64
rows, interpolated between them and extended along the last slope; a draft step of B rows is
scaled from one row's as the target's forward is. a is estimated from the
recent rounds (the maximum-likelihood estimate for a geometric run of acceptances, with older
rounds forgotten gradually and a weak prior: the run's own long-horizon acceptance once known)
and k is re-planned every few rounds. k = 0 (plain decoding) is allowed when no
speculation pays; a k = 1 probe round now and then keeps the estimate of a current. In a batch
the probe speculates for one sequence only (in turn): a round of B + 1 rows, where probing every
sequence would double a compute-bound step for evidence one sequence already gives.

The measured step times leave out what a real round adds (sampling the drafts, the draft
catching up on accepted tokens, verification, bookkeeping, attention over every sequence's own
context), and that overhead differs between k = 0 and k > 0 and between batch sizes. So every
round's wall time is compared with its modelled time, and the ratio (per batch size and k, a moving
average that forgets with the rounds gone by, not with the samples taken, so that a probe's
measurement replaces one taken PROBE_EVERY rounds earlier while the machine may have been busier;
an unmeasured pair borrows from the nearest measured pair of its kind, plain or speculating)
scales the model's round times. A round over STALL_RATIO times its expected time is set aside
unless the pair's next round agrees: a one-off cost, such as the CUDA graph a GPU captures in the
first round of each new window and key bucket, prices no k. a counts every draft position a
round asked for: a proposer may propose fewer than k, or none (the EAGLE-3 head's confidence
floor ends a chain where the head is unsure; prompt lookup finds no match; the lookup corpus
proposes at most --corpus-tokens), and a position left empty yields no token, as a rejected
one. Counted over the positions proposed only, E(k) overstated what rounds yielded (with
penalties 1.85 tokens expected where rounds yielded 1.37-1.44), and k auto speculated where plain decoding was faster (docs/decisions.md). A k = 0
probe round now and then, while speculating, keeps plain decoding's real rate known: ``k auto``
falls back to it whenever speculation does not pay. Every other probe while speculating runs
k + 1 instead, so that a longer window gets a measured time too. The step times
are measured once, in a fraction of a second; on a busy machine they can price the longer windows
up to twice too high, and a k that is never run borrows the correction of the nearest one that
is, so without these probes k auto never found out (it stayed at k = 1 through a benchmark run;
from a table priced 2x too high the probes took SD 3-15% faster, and were level with the old
probing where the measurement was right: docs/decisions.md).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specfork.config import K_MAX

logger = logging.getLogger(__name__)

PRIOR_ALPHA = 0.5  # the prior's mean until the run has evidence of its own
PRIOR_TRIALS = 4.0  # the prior's weight
RUN_PRIOR_TRIALS = 16.0  # from this much evidence on, the run's long-horizon mean is the prior
RUN_DECAY = 0.995  # per trial: the long-horizon mean forgets with a horizon of about 200 trials
REPLAN_EVERY = 8  # rounds
PROBE_EVERY = 32  # rounds between probes of another k (k = 1 at k = 0, k = 0 otherwise)
FIRST_PROBE = 4  # the round of the first probe, so that plain decoding's real cost is known early
DECAY = 0.98  # per round: acceptance counts forget with a horizon of about 50 rounds
OVERHEAD_WEIGHT = 0.3  # per round since the last: weight of a new round in measured / modelled time
STALL_RATIO = 3.0  # a round over this many times its expected time is a stall until the next one agrees


MEASURE_CONTEXT = 64  # cached tokens before a measured forward
LONG_WINDOWS = (16, 32, 64)  # rows of the longer windows measured for batched rounds


@dataclass(frozen=True)
class StepCosts:
    draft_s: float  # one draft forward of one token (0 for n-gram lookup)
    verify_s: tuple[float, ...]  # one target forward of m = 1 .. K_MAX + 1 rows, index m - 1
    long_s: tuple[tuple[int, float], ...] = ()  # (rows, seconds) of longer windows, rows ascending

    def forward_s(self, rows: int) -> float:
        """One target forward of ``rows`` rows: measured, interpolated between measured windows,
        or extended past the longest along its slope from the longest window of at most half
        its rows (a span wide enough to average out single-row steps; never decreasing)."""
        if rows <= len(self.verify_s):
            return self.verify_s[rows - 1]
        points = [*enumerate(self.verify_s, start=1), *self.long_s]
        for (r0, t0), (r1, t1) in itertools.pairwise(points):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        r1, t1 = points[-1]
        if r1 == 1:
            return t1
        r0, t0 = max(p for p in points if p[0] <= r1 / 2)
        return t1 + max(0.0, (t1 - t0) / (r1 - r0)) * (rows - r1)

    def draft_step_s(self, batch: int) -> float:
        """One draft step of ``batch`` rows, scaled from one row's as the target's forward scales."""
        return self.draft_s * self.forward_s(batch) / self.forward_s(1)


def measure_step_costs(runner, block_manager, draft_s: float, max_model_len: int, k_max: int = K_MAX) -> StepCosts:
    """The target's forwards on this machine: windows of 1..k_max + 1 rows, and of LONG_WINDOWS
    rows where the context length and the free cache allow them, after MEASURE_CONTEXT cached
    tokens (fewer where the context length is shorter)."""
    context = max(1, min(MEASURE_CONTEXT, max_model_len - k_max - 1))
    fits = [m for m in LONG_WINDOWS if m > k_max + 1 and context + m <= max_model_len
            and block_manager.blocks_for(context + m) <= block_manager.num_free_blocks]
    windows = [(m, 3) for m in range(1, k_max + 2)] + [(m, 2) for m in fits]
    seconds = measure_forwards(runner, block_manager, windows, context)
    return StepCosts(draft_s, tuple(seconds[: k_max + 1]), tuple(zip(fits, seconds[k_max + 1 :], strict=True)))


def time_call(fn: Callable[[], object], repeat: int = 5, warm_up: bool = True) -> float:
    """Median wall time of ``fn`` (after one untimed call unless not ``warm_up``); on CUDA each call
    is waited for, since kernels run asynchronously."""
    if warm_up:
        fn()
    samples = []
    for _ in range(repeat):
        _wait_for_gpu()
        t = time.perf_counter()
        fn()
        _wait_for_gpu()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _wait_for_gpu() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measurable_context(block_manager, rows: int) -> int:
    """The cached tokens a measured forward of ``rows`` more can stand on in the free cache (a
    small ``--kv-cache-tokens`` holds fewer than MEASURE_CONTEXT)."""
    return block_manager.num_free_blocks * block_manager.block_size - rows


def measure_forward(runner, block_manager, rows: int, context: int = MEASURE_CONTEXT, repeat: int = 5) -> float:
    """Median time of one decode-style forward of ``rows`` new tokens after ``context`` cached ones."""
    return measure_forwards(runner, block_manager, [(rows, repeat)], context)[0]


def measure_forwards(runner, block_manager, windows: list[tuple[int, int]], context: int = MEASURE_CONTEXT) -> list[float]:
    """For each (rows, repeat) of ``windows``, the median time of one decode-style forward of
    ``rows`` new tokens after ``context`` cached ones. The context is prefilled once (it was
    prefilled for each window, ~40% of k auto's start-up measurement): every window writes the
    positions after it and reads only those it wrote itself. On the CPU only the first window is
    warmed up (the same costs within the noise, in 0.48 s where a warm-up and 5 timed calls per
    window took 0.78 s); on CUDA every window is, since a new shape's first step captures a graph."""
    from specfork.engine.sequence import Sequence
    from specfork.sampling_params import SamplingParams

    vocab = runner.model.config.vocab_size
    max_rows = max(rows for rows, _ in windows)
    rotary = getattr(runner.model, "rotary", None)  # its table: the positions the model was built for
    room = measurable_context(block_manager, max_rows)
    if rotary is not None:  # a model (or --max-model-len) shorter than the measured context
        room = min(room, rotary.cos.shape[0] - max_rows)
    context = max(1, min(context, room))
    tokens = [(1 + i * 7919) % vocab for i in range(context + max_rows)]
    seq = Sequence(-1, tokens, SamplingParams(temperature=0.0), torch.Generator())
    block_manager.grow(seq, len(tokens))
    try:
        runner.forward([seq], [0], [tokens[:context]], [context - 1], decode=False)
        times = []
        for i, (rows, repeat) in enumerate(windows):
            feed = tokens[context : context + rows]
            times.append(time_call(lambda feed=feed, rows=rows: runner.forward([seq], [context], [feed], list(range(rows))),
                                   repeat, warm_up=i == 0 or runner.device.type != "cpu"))
        return times
    finally:
        block_manager.free(seq)


@dataclass(frozen=True)
class Plan:
    k: int
    alpha: float
    expected_tokens: float  # per sequence
    round_s: float
    batch: int = 1

    @property
    def tokens_per_s(self) -> float:
        """The batch's expected rate."""
        return self.batch * self.expected_tokens / self.round_s


def plan(costs: StepCosts, alpha: float, k_max: int = K_MAX,
         overhead: Callable[[int], float] = lambda k: 1.0, batch: int = 1) -> list[Plan]:
    """The expected rate of every k in 0..k_max for rounds of ``batch`` sequences, best first;
    ``overhead(k)`` scales the modelled round time of k (measured / modelled)."""
    plans = []
    for k in range(0, k_max + 1):
        expected = float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        plans.append(Plan(k, alpha, expected, modelled_round_s(costs, k, batch) * overhead(k), batch))
    return sorted(plans, key=lambda p: -p.tokens_per_s)


def modelled_round_s(costs: StepCosts, k: int, batch: int = 1) -> float:
    """T(B, k) = k * t_draft(B) + t_forward(B * (k + 1))."""
    return k * costs.draft_step_s(batch) + costs.forward_s(batch * (k + 1))


class AutoK:
    """Holds the current choice of k and revises it as acceptance is observed."""

    def __init__(self, costs: StepCosts, k_max: int = K_MAX) -> None:
        self.costs = costs
        self.k_max = k_max
        self.accepted = 0.0
        self.trials = 0.0
        self.run_accepted = 0.0  # the same counts, forgotten per trial rather than per round
        self.run_trials = 0.0
        self.rounds = 0
        self._since_plan = 0
        self._overhead: dict[tuple[int, int], float] = {}  # (batch, k) -> moving average of measured / modelled
        self._measured_at: dict[tuple[int, int], int] = {}  # (batch, k) -> the round of its last update
        self._stalled: set[tuple[int, int]] = set()  # pairs whose last round was set aside as a stall
        self.rounds_by_k: Counter[str] = Counter()  # "k=N" (every sequence at k = N) or "probe" (mixed)
        plans = plan(costs, self.alpha, k_max)
        self.current = plans[0]
        self.current_plain = next(p for p in plans if p.k == 0)  # plain decoding priced with the choice
        logger.info("k auto: %s", self.explain())

    @property
    def prior(self) -> float:
        """What the estimate returns to while plain decoding gathers no evidence: the run's own
        long-horizon acceptance once it has some, else PRIOR_ALPHA. (A fixed prior pulled the
        estimate back to 0.5 within ~100 plain rounds, and k auto then speculated again on no
        new evidence: 54 rounds at k = 2, each 1.85x a plain round, in 3 ShareGPT prompts where
        speculation did not pay.)"""
        if self.run_trials < RUN_PRIOR_TRIALS:
            return PRIOR_ALPHA
        return self.run_accepted / self.run_trials

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior * PRIOR_TRIALS) / (self.trials + PRIOR_TRIALS)

    def ks_for_round(self, batch: int = 1) -> list[int]:
        """How many tokens each of the next round's ``batch`` sequences proposes (a new batch size
        is planned for at once)."""
        self.rounds += 1
        if batch != self.current.batch:
            self._replan(batch)
        if self.rounds % PROBE_EVERY != FIRST_PROBE:
            return [self.current.k] * batch
        if self.current.k > 0:
            # Speculating, the probes alternate: plain decoding, then one token more than k.
            if self.rounds // PROBE_EVERY % 2 and self.current.k < self.k_max:
                return [self.current.k + 1] * batch
            return [0] * batch
        turn = self.rounds // PROBE_EVERY % batch
        return [int(i == turn) for i in range(batch)]

    def overhead(self, k: int, batch: int = 1) -> float:
        """Measured / modelled round time of k at ``batch`` sequences. An unmeasured pair borrows
        from a measured round of the same kind (plain, k = 0, or speculating, k > 0: their
        overheads differ most): the nearest batch size (by ratio), then the nearest k (the
        nearest below on a tie); 1 before any round of its kind."""
        if (batch, k) in self._overhead:
            return self._overhead[(batch, k)]
        same_kind = [bk for bk in self._overhead if (bk[1] > 0) == (k > 0)]
        if not same_kind:
            return 1.0
        nearest = min(same_kind, key=lambda bk: (abs(math.log2(bk[0] / batch)), abs(bk[1] - k), bk[1]))
        return self._overhead[nearest]

    def observe(self, asked: int, accepted: int) -> None:
        """One sequence's round: it asked its proposer for ``asked`` draft tokens (k, or fewer
        near max_tokens or the context's end) and ``accepted`` of them were accepted. A position
        the proposer left empty ends the run as a rejection does."""
        if asked == 0:
            return
        trials = accepted + (1 if accepted < asked else 0)
        self.accepted += accepted
        self.trials += trials
        forget = RUN_DECAY**trials
        self.run_accepted = self.run_accepted * forget + accepted
        self.run_trials = self.run_trials * forget + trials

    def plain_rounds(self) -> int:
        """How many plain rounds (every sequence at k = 0) may run back to back from the current
        one, as one call of several decode steps, before a round that may choose otherwise: the
        next probe, or the round after the next re-plan. While speculating, a plain probe runs as
        many as a call at k = 0 would (up to the next re-plan; the caller caps them at its decode
        steps), so that plain decoding is priced at the rate it would run at: probed one
        step a call, it was priced with a call's fixed costs per token (at temperature 1 a fifth
        of a step), and k auto kept n-gram SD speculating at 0.88x AR where plain decoding was
        faster (docs/decisions.md)."""
        if self.current.k > 0:
            return max(1, REPLAN_EVERY - self._since_plan)
        to_probe = (FIRST_PROBE - self.rounds) % PROBE_EVERY or PROBE_EVERY  # the next probe's round, ahead
        return max(1, min(to_probe, REPLAN_EVERY - self._since_plan))

    def end_round(self, ks: list[int], seconds: float, rounds: int = 1) -> None:
        """A round whose sequences proposed up to ``ks`` tokens each took ``seconds`` of wall
        time (a round mixing several k, a probe in a batch, is priced by no single k); with
        ``rounds`` > 1, that many plain rounds ran in one call (``plain_rounds`` allowed them) and
        count as one step a call counts them, each taking an equal share of ``seconds``; whether
        the call was a stall is judged once, for all of them (its shares would agree with each
        other, and so pass the stall's "next round agrees" as a slowdown that lasts)."""
        k, batch = max(ks), len(ks)
        ratio = seconds / rounds / max(modelled_round_s(self.costs, k, batch), 1e-9)  # measured / modelled
        stall = min(ks) == k and self._stall(k, batch, ratio)
        for i in range(rounds):
            if i:
                self.rounds += 1
            self._end_one_round(ks, ratio, stall)

    def _end_one_round(self, ks: list[int], ratio: float, stall: bool) -> None:
        k, batch = max(ks), len(ks)
        self.rounds_by_k[f"k={k}" if min(ks) == k else "probe"] += 1
        if min(ks) == k and not stall:
            # An old measurement counts less the older it is (the shared machine's pace moves): one
            # round ago it keeps 1 - OVERHEAD_WEIGHT, a probe's last, PROBE_EVERY rounds ago, ~0.
            old = self._overhead.get((batch, k))
            keep = (1 - OVERHEAD_WEIGHT) ** (self.rounds - self._measured_at.get((batch, k), self.rounds - 1))
            self._overhead[(batch, k)] = ratio if old is None else keep * old + (1 - keep) * ratio
            self._measured_at[(batch, k)] = self.rounds
        self.accepted *= DECAY
        self.trials *= DECAY
        self._since_plan += 1
        if self._since_plan >= REPLAN_EVERY:
            self._replan(self.current.batch)

    def _stall(self, k: int, batch: int, ratio: float) -> bool:
        """Whether this round of k at ``batch``, ``ratio`` times its modelled time, is set aside:
        it took over STALL_RATIO times what the pair's rounds are expected to take (the model's
        time scaled by the pair's measured, or borrowed, overhead), and the pair's previous round
        was not set aside too. A one-off cost
        then prices no k: on a GPU the first round of a new window length or key bucket captures
        a CUDA graph, ~50 ms against a 4-5 ms round (an H200, docs/benchmarks.md), and such
        rounds, weighted like any other, priced k = 3 at 12x its time, so that k auto decoded
        plainly or at k = 1 where k = 3 was 1.14x faster. A slowdown that lasts is believed from
        its second round."""
        if ratio <= STALL_RATIO * self.overhead(k, batch) or (batch, k) in self._stalled:
            self._stalled.discard((batch, k))
            return False
        self._stalled.add((batch, k))
        return True

    def _replan(self, batch: int) -> None:
        self._since_plan = 0
        plans = plan(self.costs, self.alpha, self.k_max, lambda k: self.overhead(k, batch), batch)
        best = plans[0]
        if best.k != self.current.k:
            logger.info("k auto: k %d -> %d (%s)", self.current.k, best.k, self._why(best))
        self.current, self.current_plain = best, next(p for p in plans if p.k == 0)

    def explain(self) -> str:
        """The current choice with everything it rests on (the start-up and change logs)."""
        return self._why(self.current)

    def summary(self) -> str:
        """The current choice in one phrase: k, the acceptance and the expected gain, both rates
        priced when the choice was made (the step costs' corrections move between choices)."""
        chosen, ar = self.current, self.current_plain
        return (f"{_label(chosen)} (acceptance per token {chosen.alpha:.2f}: {chosen.tokens_per_s:.0f} tok/s "
                f"expected against {ar.tokens_per_s:.0f} without speculation)")

    def _plain(self, batch: int) -> Plan:
        """Plain decoding's plan at ``batch`` sequences (what a choice is measured against)."""
        return plan(self.costs, self.alpha, 0, lambda k: self.overhead(k, batch), batch)[0]

    def _why(self, chosen: Plan) -> str:
        ar = self._plain(chosen.batch)
        verify = ", ".join(f"{t * 1000:.1f}" for t in self.costs.verify_s)
        per_seq = " per sequence" if chosen.batch > 1 else ""
        return (
            f"{_label(chosen)}: acceptance per token a={chosen.alpha:.2f} (recent draft positions asked for, weighted: "
            f"{self.trials:.0f}), "
            f"draft step {self.costs.draft_s * 1000:.2f} ms, target forward of 1..{len(self.costs.verify_s)} rows "
            f"[{verify}] ms, measured rounds {self.overhead(chosen.k, chosen.batch):.2f}x the model's -> "
            f"{chosen.expected_tokens:.2f} tokens{per_seq} per {chosen.round_s * 1000:.1f} ms round = "
            f"{chosen.tokens_per_s:.1f} tok/s expected vs {ar.tokens_per_s:.1f} tok/s without speculation"
        )


def _label(chosen: Plan) -> str:
    """How the explanation and the summary name a choice: "k=3", or "k=3 at batch 8" for a batch."""
    return f"k={chosen.k}" + (f" at batch {chosen.batch}" if chosen.batch > 1 else "")
