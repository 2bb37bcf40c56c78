"""Continuous batching: which sequences run in the next forward pass, and with how many tokens.

A step is either a *prefill* step (waiting sequences compute their uncached tokens, in chunks
when a prompt exceeds the token budget; with the prefix cache on, a prompt's leading full blocks
that an earlier sequence computed are taken as they are) or a *decode* step (every running
sequence advances).
When the KV cache runs out during decode, the most recently admitted sequence is preempted:
its blocks are freed and it waits at the front of the queue (behind a partly prefilled prompt,
which keeps its blocks) to be recomputed later. Nothing is dropped and nothing is corrupted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specfork.engine.block_manager import BlockManager
from specfork.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


def _prefill_end(seq: Sequence) -> int:
    """Where a waiting sequence's prefill stops: a prompt's last token (which samples the first
    output token), or, for a sequence recomputed after preemption, the token before its last. Its
    last token is then computed by the next decode step, as it would have been without the
    preemption, so that a step that draws random numbers per round (speculative decoding) draws
    the same ones and a seeded request reproduces its output."""
    return len(seq) - 1 if seq.num_output_tokens else len(seq)


class PrefixUser(Protocol):
    """What else holds state per prompt position (the step's drafter): how much of a cached
    prefix it can follow, and that a sequence took one."""

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """How many of the first ``num_tokens`` cached tokens (whole blocks) ``seq`` may take."""
        ...

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """``seq`` took its first ``num_tokens`` tokens from the cache (at most what
        ``usable_prefix`` allowed)."""
        ...


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes this step
    is_prefill: bool
    samples: list[bool] = field(init=False)  # whether each sequence reaches its last token (and samples)

    def __post_init__(self) -> None:
        self.samples = [s.num_cached_tokens + n == len(s) for s, n in zip(self.seqs, self.num_new_tokens, strict=True)]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_release: Callable[[Sequence], None] | None = None,
        prefix_user: PrefixUser | None = None,
        lookahead_limit: int | None = None,
    ) -> None:
        self.blocks = block_manager
        # Where a step never writes past the model's length (plain decoding's steps in one call
        # stop there), its lookahead reserves no slots beyond it either; a verify window does not stop,
        # so SD's engine leaves this None and its KV capacity is cut by k instead.
        self.lookahead_limit = lookahead_limit
        self.on_release = on_release  # told when a sequence's KV is dropped (preempted or finished)
        self.prefix_user = prefix_user  # asked how much of a cached prefix a sequence may take
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int = 0) -> ScheduledBatch | None:
        """Pick the next batch. Decode steps reserve ``1 + lookahead`` slots per sequence
        (speculative steps and plain decoding's steps in one call write several tokens; the latter's
        reservation stops at ``lookahead_limit``)."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        return self._schedule_decode(lookahead)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        counts: list[int] = []
        budget = self.max_num_batched_tokens
        completing: set[bytes] = set()  # keys of the full blocks this step's prompts compute
        while self.waiting and budget > 0 and len(self.running) + len(seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            # Blocks of its prompt computed before (not for a request wanting every prompt row's
            # log-probabilities), taken only once it is admitted: a sequence left waiting holds
            # none, so two waiting ones cannot starve each other of the blocks they both cached.
            hits, follows = self._cached_prefix(seq)
            if completing and follows and self._next_block_key(seq, hits) in completing:
                break  # its next block is being computed in this step: it takes it next step
            cached = seq.num_cached_tokens + len(hits) * self.blocks.block_size
            uncached = _prefill_end(seq) - cached
            chunk = min(uncached, budget)
            # Leave one free block per running sequence so that admitting a prompt does not
            # immediately force the running ones into preemption.
            headroom = len(self.running) + len(seqs)
            free = self.blocks.num_free_blocks - self.blocks.idle_among(hits)
            needed = self.blocks.blocks_for(cached + chunk) - len(seq.block_table) - len(hits)
            if needed + headroom > free and (self.running or seqs):
                break
            if needed > free:
                break
            if hits:
                if self.prefix_user is not None:
                    self.prefix_user.adopt_prefix(seq, cached)
                self.blocks.take_prefix(seq, hits)
                if not seq.num_output_tokens:
                    seq.num_prompt_tokens_reused = cached
            self.blocks.grow(seq, cached + chunk)
            if self.blocks.prefix_caching and len(self.waiting) > 1 and chunk == uncached:  # others may follow
                completing.update(self.blocks.keys_after(seq.token_ids, seq.block_keys, cached + chunk))
            seqs.append(seq)
            counts.append(chunk)
            budget -= chunk
            if chunk < uncached:
                break  # partially prefilled: it stays first in line and continues next step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        if not seqs:
            if self.waiting and not self.running:
                # Nothing runs, so nothing will free blocks: the cache is too small for this prompt.
                raise RuntimeError("KV cache too small for a single waiting sequence")
            return None
        return ScheduledBatch(seqs, counts, is_prefill=True)

    def _cached_prefix(self, seq: Sequence) -> tuple[list[tuple[int, bytes]], bool]:
        """The cached blocks a waiting sequence holding none may start from: not for a request
        wanting every prompt row's log-probabilities, never its last token (which must be
        computed), and only as far as the step can follow (a drafter's own cached rows); and
        whether the step followed the cache as far as it reached (else waiting for more of it
        would gain nothing)."""
        if seq.block_table or seq.params.prompt_logprobs is not None or not self.blocks.prefix_caching:
            return [], False
        found = self.blocks.cached_prefix(seq.token_ids, _prefill_end(seq) - 1)
        hits = found
        if found and self.prefix_user is not None:
            size = self.blocks.block_size
            hits = found[: self.prefix_user.usable_prefix(seq, len(found) * size) // size]
        return hits, len(hits) == len(found)

    def _next_block_key(self, seq: Sequence, hits: list[tuple[int, bytes]]) -> bytes | None:
        """The key of the first block past ``hits`` that ``seq`` could take from the cache once
        computed (None: there is none, or it may take none). Sequences admitted together with the
        same prompt start (a request's ``n`` choices, a shared system prompt) would each compute
        it; deferring the later ones a step lets them take it instead."""
        if seq.block_table or seq.params.prompt_logprobs is not None:
            return None
        end = min(_prefill_end(seq) - 1, (len(hits) + 1) * self.blocks.block_size)
        following = self.blocks.keys_after(seq.token_ids, [key for _, key in hits], end)
        return following[0] if following else None

    def _schedule_decode(self, lookahead: int) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            need = len(seq) + lookahead
            if self.lookahead_limit is not None:
                need = max(len(seq), min(need, self.lookahead_limit))
            while not self.blocks.can_grow(seq, need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.grow(seq, need)
                scheduled.append(seq)
        if not scheduled:
            return None
        return ScheduledBatch(scheduled, [s.num_uncached_tokens for s in scheduled], is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting sequence %d (%d tokens) to free KV blocks", seq.seq_id, len(seq))
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # First in line, except behind a partly prefilled sequence: that one holds its blocks, and
        # were it passed over, two waiting sequences could hold blocks that neither can grow into
        # once nothing runs (the only one ever holding blocks while waiting is the head).
        head = self.waiting[0] if self.waiting else None
        self.waiting.insert(1 if head is not None and head.block_table else 0, seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED

    def _free(self, seq: Sequence) -> None:
        # its computed blocks stay findable: for its own return after preemption, a prompt
        # repeating it, or a conversation's next turn
        self.blocks.register(seq, seq.token_ids, seq.num_cached_tokens)
        self.blocks.free(seq)
        if self.on_release is not None:
            self.on_release(seq)
