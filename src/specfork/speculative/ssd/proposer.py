"""The target side of SSD: a :class:`~specfork.speculative.proposer.Proposer` whose drafts come from
the drafter process.

Each round it sends, per sequence, the tokens committed since its last request (ending with
the new ``rec``) and the number of drafts accepted, and waits for the speculation. The drafter
pre-drafts the next round while the target verifies this one.

If the drafter dies, fails to start or does not answer in time (``deadline``: a fixed timeout,
or by default one that follows the observed rounds), the error is logged, the process is
killed, and every request continues with the in-process fallback (SD with the same draft, or AR
if even that cannot load): outputs are unaffected, since every speculative mode reproduces AR's
distribution. Meanwhile a new drafter process is started in the background, after a backoff
that doubles with each failure in a row; once it reports ready, sequences go back to it.
``health()`` says ``degraded`` while no drafter serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specfork.engine.sequence import Sequence
from specfork.engine.step import StepHealth
from specfork.speculative.proposer import NoProposals, Proposal, Proposer
from specfork.speculative.ssd.deadline import DrafterDeadline
from specfork.speculative.ssd.messages import DrafterLaunch, SpecRequest
from specfork.speculative.ssd.transport import DrafterError, DrafterProcess

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
RESTART_BACKOFF_S = 2.0  # before the first restart; doubles with each failure in a row
MAX_BACKOFF_S = 60.0


@dataclass
class SSDStats:
    """Speculation-cache counters of one request.

    ``drafter_s`` is the drafter's work attributed to this request's rounds (answering plus
    pre-drafting); the part of it the target did not wait for was hidden behind verification.
    """

    requests: int = 0
    hits: int = 0
    hit_rounds: int = 0
    hit_emitted: int = 0
    miss_rounds: int = 0
    miss_emitted: int = 0
    drafter_s: float = 0.0
    wait_s: float = 0.0
    last_hit: bool = False

    def record_round(self, num_accepted: int) -> None:
        if self.last_hit:
            self.hit_rounds += 1
            self.hit_emitted += num_accepted + 1
        else:
            self.miss_rounds += 1
            self.miss_emitted += num_accepted + 1

    def as_metrics(self) -> dict:
        return {
            "ssd_requests": self.requests,
            "ssd_cache_hits": self.hits,
            "ssd_cache_hit_rate": self.hits / self.requests if self.requests else None,
            "ssd_accepted_length_on_hits": self.hit_emitted / self.hit_rounds if self.hit_rounds else None,
            "ssd_accepted_length_on_misses": self.miss_emitted / self.miss_rounds if self.miss_rounds else None,
            "ssd_drafter_s": self.drafter_s,
            "ssd_hidden_fraction": max(0.0, 1.0 - self.wait_s / self.drafter_s) if self.drafter_s else None,
        }


class SSDProposer:
    def __init__(
        self,
        launch: DrafterLaunch,
        *,
        vocab_size: int,
        device: torch.device,
        timeout_s: float | None,
        fallback: Callable[[], Proposer],
        pin_target: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        drafter: DrafterProcess | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        """``timeout_s``: a fixed drafter timeout, or None to follow the observed rounds.
        ``pin_target(True)`` keeps the target on its own cores while a drafter runs on the others;
        ``pin_target(False)`` gives it every core back (drafter down, or closed). ``drafter``: a
        process started earlier (its interpreter warm) and not yet launched; None starts one.
        ``feature_layers``: the target layers whose features the drafter reads (an EAGLE-3 head);
        they go to it with each sequence's next request."""
        self.launch = launch
        self.feature_layers = feature_layers
        self._features: dict[int, tuple[int, list[torch.Tensor]]] = {}  # seq -> (first position, rows)
        self.vocab_size = vocab_size
        self.device = device  # the target's: q is verified there
        self.deadline = DrafterDeadline(timeout_s)
        self._make_fallback = fallback
        self._pin_target = pin_target
        self._pinned = False
        self._clock = clock
        self.fallback: Proposer | None = None
        self.failure: str | None = None  # the last failure
        self.failures = 0
        self.restarts = 0
        self._failures_in_a_row = 0
        self._restart_at: float | None = None
        self._starting: DrafterProcess | None = None
        self._starting_until = 0.0
        self._live: dict[int, Sequence] = {}  # sequences proposed for and not released
        self._sent: dict[int, int] = {}  # tokens of each sequence the drafter has been told
        self._accepted: dict[int, int | None] = {}
        self._released: list[int] = []
        # Sequences in flight when a drafter that reads features failed: their earlier features
        # died with it, so no later drafter can draft for them (a restarted one served them n-gram
        # guesses, 3% of them accepted, each a verify row): they are asked for no drafts.
        self._orphans: set[int] = set()
        self._pin(True)
        self.drafter: DrafterProcess | None = drafter if drafter is not None else DrafterProcess()
        self.process = self.drafter.process  # of the newest drafter (tests and diagnostics)
        self._restartable = self.drafter.restartable
        try:
            self.drafter.send(launch)
            if self.drafter.ready(STARTUP_TIMEOUT_S) is None:
                raise DrafterError(f"it did not start within {STARTUP_TIMEOUT_S:.0f} s")
        except DrafterError as e:
            self._fail(f"the drafter process could not start: {e}")

    # -- Proposer -------------------------------------------------------------------------

    def observe_features(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        if self.drafter is not None:  # the first position of a run is kept; later rows follow it
            self._features.setdefault(seq.seq_id, (first_position, []))[1].append(features)
        elif self.feature_layers:  # features no drafter will see: the next one cannot draft for it
            self._orphans.add(seq.seq_id)
        if self.fallback is not None:
            self.fallback.observe_features(seq, first_position, features)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        for s in seqs:
            self._live[s.seq_id] = s
        if self.drafter is None:
            self._restart_if_due()
        if self.drafter is not None:
            if self._orphans:
                num_tokens = [0 if s.seq_id in self._orphans else n for s, n in zip(seqs, num_tokens, strict=True)]
            proposal = self._ask(seqs, num_tokens)
            if proposal is not None:
                return proposal
        return self._fallback_proposer().propose(seqs, num_tokens)

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        if seq.seq_id in self._sent and self.drafter is not None:
            self._accepted[seq.seq_id] = num_accepted
            stats = seq.stats.get("ssd")
            if stats is not None:
                stats.record_round(num_accepted)
        if self.fallback is not None:
            self.fallback.accepted(seq, num_accepted)

    def release(self, seq: Sequence) -> None:
        if self._sent.pop(seq.seq_id, None) is not None:
            self._released.append(seq.seq_id)
        self._accepted.pop(seq.seq_id, None)
        self._features.pop(seq.seq_id, None)
        self._live.pop(seq.seq_id, None)
        self._orphans.discard(seq.seq_id)
        if self.fallback is not None:
            self.fallback.release(seq)

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """A draft model runs the tokens it is sent itself; a head in the drafter process needs
        the target's features of every prompt position, so its sequences take no cached prefix."""
        return 0 if self.feature_layers else num_tokens

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        pass

    def idle(self) -> None:
        """Between requests: a drafter process that died is noticed (health says degraded at
        once, not at the next request), and one due to restart is started."""
        process = getattr(self.drafter, "process", None)
        if process is not None and process.poll() is not None:
            self._fail(f"the drafter process exited (code {process.returncode})")
        if self.drafter is None:
            try:
                self._restart_if_due()
            except OSError as e:  # no process could start (limits, a changed cpuset): try again later
                self._fail(f"the drafter process could not be restarted ({type(e).__name__}: {e})")

    def health(self) -> StepHealth:
        degraded = None
        if self.drafter is None:
            degraded = f"SSD drafter down ({self.failure}); drafting in-process " + (
                "while it restarts" if self._restartable else "from now on (a drafter rank is not restarted)")
        return StepHealth(degraded=degraded, drafter_failures=self.failures, drafter_restarts=self.restarts)

    # -- the drafter ------------------------------------------------------------------------

    def _ask(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal | None:
        """This round's proposal from the drafter, or None if it failed now."""
        requests = [
            SpecRequest(
                seq_id=s.seq_id,
                new_tokens=s.token_ids[self._sent.get(s.seq_id, 0) :],
                num_accepted=self._accepted.get(s.seq_id),
                params=s.params,
                num_tokens=n,
            )
            for s, n in zip(seqs, num_tokens, strict=True)
        ]
        for r in requests:
            first, rows = self._features.pop(r.seq_id, (0, None))
            if rows:
                r.features_from = first
                r.features = (torch.cat(rows) if len(rows) > 1 else rows[0]).float().cpu().numpy()
        released, self._released = self._released, []
        sending = sum(len(r.new_tokens) for r in requests)
        timeout = self.deadline.timeout(sending)
        started = time.perf_counter()
        try:
            reply = self.drafter.request(("spec", requests, released), timeout)
        except DrafterError as e:
            self._fail(str(e))
            return None
        waited = time.perf_counter() - started
        self.deadline.observe(waited, sending)
        self._failures_in_a_row = 0
        for s in seqs:
            self._sent[s.seq_id] = len(s.token_ids)
        return self._proposal(seqs, num_tokens, reply[1], reply[2], waited)

    def _fail(self, reason: str) -> None:
        """The drafter failed: kill it, go on in-process, and schedule a restart (a process; a
        rank cannot come back)."""
        self.failure = reason
        self.failures += 1
        self._failures_in_a_row += 1
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        self._sent.clear()
        self._accepted.clear()
        self._released.clear()
        if self.feature_layers:  # the sequences in flight (or waiting with features) get no more drafts
            self._orphans.update(self._live)
            self._orphans.update(self._features)
        self._features.clear()
        self._pin(False)  # the drafter's cores are free meanwhile
        if not self._restartable:
            self._restart_at = None
            logger.error("SSD: %s; continuing in-process for the rest of the run (generations are not affected; "
                         "a drafter rank cannot rejoin the world)", reason)
            return
        backoff = min(MAX_BACKOFF_S, RESTART_BACKOFF_S * 2 ** (self._failures_in_a_row - 1))
        self._restart_at = self._clock() + backoff
        logger.error("SSD: %s; continuing in-process (generations are not affected); restarting the drafter "
                     "in %.0f s", reason, backoff)

    def _restart_if_due(self) -> None:
        """Start a new drafter once the backoff has passed, and switch to it once it is ready
        (checked without waiting, once per round)."""
        now = self._clock()
        if self._starting is None:
            if self._restart_at is None or now < self._restart_at:
                return
            self._pin(True)
            self._starting = DrafterProcess(self.launch)
            self._starting_until = now + STARTUP_TIMEOUT_S
            self.process = self._starting.process
        try:
            info = self._starting.ready(0)
            if info is None and now > self._starting_until:
                raise DrafterError(f"the restarted drafter did not start within {STARTUP_TIMEOUT_S:.0f} s")
        except DrafterError as e:
            self._starting.close()
            self._starting = None
            self._fail(str(e))
            return
        if info is None:
            return
        self.drafter, self._starting = self._starting, None
        self.restarts += 1
        if self.fallback is not None:  # the new drafter serves every sequence afresh
            for seq in self._live.values():
                self.fallback.release(seq)
        logger.warning("SSD: drafter process restarted (pid %d) after %d failure(s)", self.drafter.pid,
                       self._failures_in_a_row)

    def _fallback_proposer(self) -> Proposer:
        if self.fallback is None:
            try:
                self.fallback = self._make_fallback()
            except Exception as e:  # even the in-process draft cannot load: AR
                logger.error("SSD: in-process fallback draft unavailable (%s); continuing with AR", e)
                self.fallback = NoProposals()
        return self.fallback

    def _pin(self, on: bool) -> None:
        if self._pin_target is not None and on != self._pinned:
            self._pin_target(on)
        self._pinned = on

    # -- transport ------------------------------------------------------------------------

    def _proposal(self, seqs: list[Sequence], num_tokens: list[int], replies, drafter: dict, waited: float) -> Proposal:
        tokens = [r.tokens[:n] for r, n in zip(replies, num_tokens, strict=True)]
        probs = [None if r.probs is None else torch.from_numpy(r.probs) for r in replies]
        proposal = Proposal.of(tokens, probs, self.vocab_size, self.device)
        work = drafter["answer_s"] + drafter["prepare_s"]
        for s, r in zip(seqs, replies, strict=True):
            stats = s.stats.setdefault("ssd", SSDStats())
            stats.requests += 1
            stats.last_hit = r.source == "hit"
            stats.hits += int(stats.last_hit)
            stats.drafter_s += work
            stats.wait_s += waited
        return proposal

    def close(self) -> None:
        """Stop the drafter process (and one being started); idempotent."""
        if self.drafter is not None:
            self.drafter.close()
        if self._starting is not None:
            self._starting.close()
            self._starting = None
        self._restart_at = None
        self._pin(False)
