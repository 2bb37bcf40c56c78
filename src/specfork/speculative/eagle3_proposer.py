"""EAGLE-3 proposer (SD): an EAGLE-3 head drafts a chain from the target's own features.

The target hands over the features of every position it computes (prefill chunks, and the
accepted positions of each verification). Before a round, the head runs once over the positions
verified since its last round, with the target's features, writing its KV cache for them; the
last of those positions predicts the first draft token. Each further token is one head step on
its own output (the head's stand-in for features the target has not computed). Those steps'
KV entries are overwritten the next round, with the target's features once they exist.

A chain stops early when the head's probability of the whole chain falls below
``min_confidence``. Draft tokens come from the head's reduced vocabulary; their distribution q
is scattered into the target's vocabulary (zero elsewhere) before verification, so a target
token the head cannot propose is still produced with its exact probability.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specfork.engine.block_manager import BlockManager
from specfork.engine.model_runner import ModelRunner
from specfork.engine.sequence import Sequence
from specfork.sampling import sample
from specfork.speculative.draft_runner import DraftState, last_rows
from specfork.speculative.proposer import Proposal

logger = logging.getLogger(__name__)


@dataclass
class HeadState(DraftState):
    """One sequence in the head's cache: entries for positions < ``num_cached_tokens`` were
    computed from the target's features; ``features`` are the target's features of the
    positions after them, in order, not yet run through the head."""

    features: list[torch.Tensor] = field(default_factory=list)
    num_features: int = 0
    broken: bool = False  # features went missing: the sequence gets no proposals

    def take_features(self) -> torch.Tensor:
        rows = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        self.features, self.num_features = [], 0
        return rows


class Eagle3Proposer:
    def __init__(self, head, *, feature_layers: tuple[int, ...], vocab_size: int, num_blocks: int,
                 block_size: int, device: torch.device, min_confidence: float = 0.0) -> None:
        self.head = head
        self.runner = ModelRunner(head, num_blocks=num_blocks, block_size=block_size, device=device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.feature_layers = feature_layers
        self.vocab_size = vocab_size
        self.device = device
        self.min_confidence = min_confidence
        self._states: dict[int, HeadState] = {}

    def observe_features(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        st = self._states.setdefault(seq.seq_id, HeadState())
        if st.broken or not len(features):
            return
        if first_position != st.num_cached_tokens + st.num_features:
            logger.warning("EAGLE-3 head: features of sequence %d arrived out of order (position %d, expected %d); "
                           "it gets no more proposals", seq.seq_id, first_position,
                           st.num_cached_tokens + st.num_features)
            st.broken = True
            return
        st.features.append(features)
        st.num_features += len(features)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        states = [self._states.setdefault(s.seq_id, HeadState()) for s in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, n in enumerate(num_tokens) if n > 0 and self._ready(states[i], seqs[i])]
        if not active:
            return Proposal(tokens, None)
        for i in active:
            self.blocks.grow(states[i], len(seqs[i]) - 2 + num_tokens[i])
        # First step: the verified positions, with the target's features; the last row of each drafts.
        feeds = [seqs[i].token_ids[states[i].num_cached_tokens + 1:] for i in active]
        starts = [states[i].num_cached_tokens for i in active]
        hidden = self.head.project(torch.cat([states[i].take_features() for i in active]))
        decode = max(len(f) for f in feeds) <= max(num_tokens) + 1  # longer: a prompt, a prefill pass
        out = self._step([states[i] for i in active], starts, feeds, hidden, decode=decode)
        last = torch.tensor(last_rows(feeds), device=self.device)
        out = out.index_select(0, last)
        for i in active:
            states[i].num_cached_tokens = len(seqs[i]) - 1
        confidence = [1.0] * len(seqs)
        step = 0
        while active:
            drafted, q, p = self._draw(out, [seqs[i] for i in active])
            keep = []
            for row, i in enumerate(active):
                tokens[i].append(drafted[row])
                if q is not None and not seqs[i].params.greedy:
                    probs[i].append(q[row])
                confidence[i] *= p[row]
                if len(tokens[i]) < num_tokens[i] and confidence[i] >= self.min_confidence:
                    keep.append(row)
            active = [active[r] for r in keep]
            if not active:
                break
            out = out.index_select(0, torch.tensor(keep, device=self.device))
            step += 1
            # The head's own output stands in for the features of the position after.
            starts = [len(seqs[i]) - 2 + step for i in active]
            out = self._step([states[i] for i in active], starts, [[tokens[i][-1]] for i in active], out, decode=True)
        return Proposal.of(tokens, [torch.stack(p) if p else None for p in probs], self.vocab_size, self.device)

    def _ready(self, st: HeadState, seq: Sequence) -> bool:
        """Whether the target's features cover every position the head still needs (all but the
        sequence's last token, whose features the next verification computes)."""
        return not st.broken and st.num_cached_tokens + st.num_features == len(seq) - 1 and st.num_features > 0

    def _step(self, states: list[HeadState], starts: list[int], feeds: list[list[int]], hidden: torch.Tensor,
              *, decode: bool) -> torch.Tensor:
        ids, pos, meta = self.runner.prepare(states, starts, feeds, decode=decode)
        return self.head(ids, pos, hidden, self.runner.kv_caches, meta)

    def _draw(self, out: torch.Tensor, seqs: list[Sequence]):
        """One token per row from the head's distribution over the target's vocabulary: (tokens,
        q [rows, V] or None when every request is greedy, the head's probability of each token;
        ones when no chain may end early)."""
        draft_logits = self.head.compute_logits(out)
        if all(s.params.greedy for s in seqs):  # the head's best token; no distribution to send
            best = draft_logits.argmax(dim=-1)
            tokens = self.head.draft_to_target.index_select(0, best).tolist()
            if not self.min_confidence:
                return tokens, None, [1.0] * len(seqs)
            confidence = torch.softmax(draft_logits, dim=-1).gather(1, best.unsqueeze(1)).squeeze(1)
            return tokens, None, confidence.tolist()
        logits = torch.full((len(seqs), self.vocab_size), float("-inf"), device=self.device)
        logits[:, self.head.draft_to_target] = draft_logits
        draw = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        head_probs = torch.softmax(logits, dim=-1)
        chosen = torch.tensor(draw.tokens, device=self.device).unsqueeze(1)
        confidence = head_probs.gather(1, chosen).squeeze(1).tolist()
        q = torch.stack([draw.q_of(r) if draw.q_of(r) is not None else head_probs[r] for r in range(len(seqs))])
        return draw.tokens, q, confidence

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        pass  # the head's entries past the verified positions are rewritten next round

    def release(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self.blocks.free(st)

    def draft_step_seconds(self) -> float:
        """Median time of one head step (a one-token decode after a 64-token context)."""
        from specfork.speculative.auto_k import time_call

        st = HeadState()
        context = 64
        self.blocks.grow(st, context + 1)
        d = self.head.config.hidden_size
        try:
            ids = [[1] * context, [1]]
            self._step([st], [0], ids[:1], torch.zeros(context, d, device=self.device), decode=False)
            return time_call(lambda: self.head.compute_logits(
                self._step([st], [context], ids[1:], torch.zeros(1, d, device=self.device), decode=True)))
        finally:
            self.blocks.free(st)
