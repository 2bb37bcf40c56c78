"""``--k auto``: choose the number of speculated tokens from measured costs and acceptance.

With a per-token acceptance probability a, a round that proposes k tokens yields
E(k) = (1 - a^(k+1)) / (1 - a) tokens (accepted ones plus the bonus) and costs
T(k) = k * t_draft + t_verify(k + 1), where t_verify(m) is one target forward over m rows. The
step times are measured once on this machine when the engine is built; a is estimated from the
recent rounds (the maximum-likelihood estimate for a geometric run of acceptances, with older
rounds forgotten gradually and a weak prior: the run's own long-horizon acceptance once known)
and k is re-planned every few rounds. k = 0 (plain decoding) is allowed when no
speculation pays; a k = 1 probe round now and then keeps the estimate of a current.

The measured step times leave out what a real round adds (sampling the drafts, the draft
catching up on accepted tokens, verification, bookkeeping), and that overhead differs between
k = 0 and k > 0. So every round's wall time is compared with its modelled time, and the ratio
(per k, a moving average; an unmeasured k borrows the nearest measured one's) scales the model's
round times. A k = 0 probe round now and then, while speculating, keeps plain decoding's real
rate known: ``k auto`` falls back to it whenever speculation does not pay.
"""

from __future__ import annotations

import logging
import statistics
import time
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
OVERHEAD_WEIGHT = 0.3  # weight of a new round in the moving average of measured / modelled time


@dataclass(frozen=True)
class StepCosts:
    draft_s: float  # one draft forward of one token (0 for n-gram lookup)
    verify_s: tuple[float, ...]  # one target forward of m = 1 .. K_MAX + 1 rows, index m - 1


def time_call(fn: Callable[[], object], repeat: int = 5) -> float:
    """Median wall time of ``fn``; on CUDA each call is waited for, since kernels run asynchronously."""
    fn()  # warm-up
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


def measure_forward(runner, block_manager, rows: int, context: int = 64) -> float:
    """Median time of one decode-style forward of ``rows`` new tokens after ``context`` cached ones."""
    from specfork.engine.sequence import Sequence
    from specfork.sampling_params import SamplingParams

    vocab = runner.model.config.vocab_size
    tokens = [(1 + i * 7919) % vocab for i in range(context + rows)]
    seq = Sequence(-1, tokens, SamplingParams(temperature=0.0), torch.Generator())
    block_manager.grow(seq, len(tokens))
    try:
        runner.forward([seq], [0], [tokens[:context]], [context - 1], decode=False)
        return time_call(lambda: runner.forward([seq], [context], [tokens[context:]], list(range(rows))))
    finally:
        block_manager.free(seq)


@dataclass(frozen=True)
class Plan:
    k: int
    alpha: float
    expected_tokens: float
    round_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tokens / self.round_s


def plan(costs: StepCosts, alpha: float, k_max: int = K_MAX,
         overhead: Callable[[int], float] = lambda k: 1.0) -> list[Plan]:
    """The expected rate of every k in 0..k_max, best first; ``overhead(k)`` scales the modelled
    round time of k (measured / modelled)."""
    plans = []
    for k in range(0, k_max + 1):
        expected = float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        plans.append(Plan(k, alpha, expected, modelled_round_s(costs, k) * overhead(k)))
    return sorted(plans, key=lambda p: -p.tokens_per_s)


def modelled_round_s(costs: StepCosts, k: int) -> float:
    """T(k) = k * t_draft + t_verify(k + 1)."""
    return k * costs.draft_s + costs.verify_s[k]


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
        self._overhead: dict[int, float] = {}  # k -> moving average of measured / modelled round time
        self.current = plan(costs, self.alpha, k_max)[0]
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

    def k_for_round(self) -> int:
        self.rounds += 1
        if self.rounds % PROBE_EVERY == FIRST_PROBE:
            return 1 if self.current.k == 0 else 0
        return self.current.k

    def overhead(self, k: int) -> float:
        """Measured / modelled round time of k; an unmeasured k borrows the nearest measured k's
        (the nearest below on a tie); 1 before any round."""
        if k in self._overhead:
            return self._overhead[k]
        if not self._overhead:
            return 1.0
        nearest = min(self._overhead, key=lambda m: (abs(m - k), m))
        return self._overhead[nearest]

    def observe(self, proposed: int, accepted: int) -> None:
        """One sequence's round: ``accepted`` of ``proposed`` draft tokens."""
        if proposed == 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        self.accepted += accepted
        self.trials += trials
        forget = RUN_DECAY**trials
        self.run_accepted = self.run_accepted * forget + accepted
        self.run_trials = self.run_trials * forget + trials

    def end_round(self, k: int, seconds: float) -> None:
        """A round that proposed up to ``k`` tokens per sequence took ``seconds`` of wall time."""
        ratio = seconds / max(modelled_round_s(self.costs, k), 1e-9)
        old = self._overhead.get(k)
        self._overhead[k] = ratio if old is None else (1 - OVERHEAD_WEIGHT) * old + OVERHEAD_WEIGHT * ratio
        self.accepted *= DECAY
        self.trials *= DECAY
        self._since_plan += 1
        if self._since_plan >= REPLAN_EVERY:
            self._since_plan = 0
            best = plan(self.costs, self.alpha, self.k_max, self.overhead)[0]
            if best.k != self.current.k:
                logger.info("k auto: k %d -> %d (%s)", self.current.k, best.k, self._why(best))
            self.current = best

    def explain(self) -> str:
        return self._why(self.current)

    def _why(self, chosen: Plan) -> str:
        ar = plan(self.costs, self.alpha, 0, self.overhead)[0]
        verify = ", ".join(f"{t * 1000:.1f}" for t in self.costs.verify_s)
        return (
            f"k={chosen.k}: acceptance per token a={chosen.alpha:.2f} (recent draft positions, weighted: "
            f"{self.trials:.0f}), "
            f"draft step {self.costs.draft_s * 1000:.2f} ms, target forward of 1..{len(self.costs.verify_s)} rows "
            f"[{verify}] ms, measured rounds {self.overhead(chosen.k):.2f}x the model's -> "
            f"{chosen.expected_tokens:.2f} tokens per {chosen.round_s * 1000:.1f} ms round = "
            f"{chosen.tokens_per_s:.1f} tok/s expected vs {ar.tokens_per_s:.1f} tok/s without speculation"
        )
