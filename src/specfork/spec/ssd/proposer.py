"""The target side of SSD: a :class:`~specfork.spec.proposer.Proposer` whose drafts come from
the drafter process.

Each round it sends, per sequence, the tokens committed since its last request (ending with
the new ``rec``) and the number of drafts accepted, and waits for the speculation. The drafter
pre-drafts the next round while the target verifies this one.

If the drafter dies, fails to start or does not answer within ``timeout_s``, the error is
logged once, the process is killed, and every request continues with the in-process fallback
(SD with the same draft, or AR if even that cannot load): greedy outputs are unchanged, since
every speculative mode reproduces AR.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from specfork.engine.sequence import Sequence
from specfork.spec.proposer import Proposal, Proposer
from specfork.spec.ssd.drafter import SpecRequest
from specfork.spec.ssd.worker import DrafterLaunch

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0


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


class NoProposals:
    """The last-resort fallback: propose nothing, i.e. plain AR through the SD step."""

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        return Proposal([[] for _ in seqs], None)

    def accepted(self, seq: Sequence) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass


class SSDProposer:
    def __init__(
        self,
        launch: DrafterLaunch,
        *,
        vocab_size: int,
        timeout_s: float,
        fallback: Callable[[], Proposer],
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """``on_close`` runs once when the proposer is closed (e.g. to give the target its cores
        back)."""
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._make_fallback = fallback
        self._on_close = on_close
        self.fallback: Proposer | None = None
        self.failure: str | None = None
        self._sent: dict[int, int] = {}  # tokens of each sequence the drafter has been told
        self._accepted: dict[int, int | None] = {}
        self._released: list[int] = []
        # A fresh interpreter (not fork: the parent's OpenMP pools do not survive a fork; not
        # multiprocessing's spawn: that re-imports the user's __main__) talking over a socket pair.
        parent_sock, child_sock = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specfork.spec.ssd.worker", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        # Whatever happens to this object, the process does not outlive it.
        self._finalizer = weakref.finalize(self, _kill, self.process)
        self._send(launch)
        reply = self._receive(STARTUP_TIMEOUT_S)
        if reply is None:
            return
        if reply[0] != "ready":
            self._fail(f"the drafter process could not start: {reply[1]}")

    # -- Proposer -------------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        if self.fallback is None:
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
            released, self._released = self._released, []
            started = time.perf_counter()
            if self._send(("spec", requests, released)):
                reply = self._receive(self.timeout_s)
                if reply is not None:
                    for s in seqs:
                        self._sent[s.seq_id] = len(s.token_ids)
                    waited = time.perf_counter() - started
                    return self._proposal(seqs, num_tokens, reply[1], reply[2], waited)
        return self.fallback.propose(seqs, num_tokens)

    def accepted(self, seq: Sequence) -> None:
        sent = self._sent.get(seq.seq_id)
        if sent is not None:
            n = len(seq.token_ids) - sent - 1
            self._accepted[seq.seq_id] = n
            stats = seq.stats.get("ssd")
            if stats is not None and self.fallback is None:
                if stats.last_hit:
                    stats.hit_rounds += 1
                    stats.hit_emitted += n + 1
                else:
                    stats.miss_rounds += 1
                    stats.miss_emitted += n + 1
        if self.fallback is not None:
            self.fallback.accepted(seq)

    def release(self, seq: Sequence) -> None:
        if self._sent.pop(seq.seq_id, None) is not None:
            self._released.append(seq.seq_id)
        self._accepted.pop(seq.seq_id, None)
        if self.fallback is not None:
            self.fallback.release(seq)

    # -- transport ------------------------------------------------------------------------

    def _proposal(self, seqs: list[Sequence], num_tokens: list[int], replies, drafter: dict, waited: float) -> Proposal:
        tokens = [r.tokens[:n] for r, n in zip(replies, num_tokens, strict=True)]
        probs = None
        k = max((len(t) for t in tokens), default=0)
        if any(not s.params.greedy for s in seqs):
            probs = torch.zeros(len(seqs), max(k, 1), self.vocab_size)
            for i, (r, t) in enumerate(zip(replies, tokens, strict=True)):
                if r.probs is not None and t:
                    probs[i, : len(t)] = torch.from_numpy(r.probs[: len(t), : self.vocab_size])
        work = drafter["answer_s"] + drafter["prepare_s"]
        for s, r in zip(seqs, replies, strict=True):
            stats = s.stats.setdefault("ssd", SSDStats())
            stats.requests += 1
            stats.last_hit = r.source == "hit"
            stats.hits += int(stats.last_hit)
            stats.drafter_s += work
            stats.wait_s += waited
        return Proposal(tokens, probs)

    def _send(self, message) -> bool:
        if self.conn.closed:
            return False
        try:
            self.conn.send(message)
            return True
        except (OSError, ValueError) as e:
            self._fail(f"the drafter process is gone ({type(e).__name__}: {e})")
            return False

    def _receive(self, timeout: float):
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
            self._fail(f"the drafter process did not answer within {timeout:.0f} s")
        except (EOFError, OSError) as e:
            self._fail(f"the drafter process is gone ({type(e).__name__}: {e})")
        except Exception as e:  # an undecodable reply: treat the drafter as broken
            self._fail(f"unreadable reply from the drafter process ({type(e).__name__}: {e})")
        return None

    def _fail(self, reason: str) -> None:
        self.failure = reason
        logger.error("SSD: %s; continuing in-process (generations are not affected)", reason)
        self._stop(kill=True)
        if self._on_close is not None:  # the drafter's cores are free again
            on_close, self._on_close = self._on_close, None
            on_close()
        try:
            self.fallback = self._make_fallback()
        except Exception as e:  # even the in-process draft cannot load: AR
            logger.error("SSD: in-process fallback draft unavailable (%s); continuing with AR", e)
            self.fallback = NoProposals()

    def _stop(self, kill: bool) -> None:
        if self.process.poll() is None:
            if not kill:
                try:
                    self.conn.send(("exit",))
                    self.process.wait(timeout=5)
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    pass
            _kill(self.process)
        self.conn.close()

    def close(self) -> None:
        """Stop the drafter process (idempotent)."""
        if not self.conn.closed:
            self._stop(kill=False)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        logger.error("SSD: drafter process %d did not exit after SIGKILL", process.pid)
