"""EAGLE-3 proposer (SD): an EAGLE-3 head drafts a chain from the target's own features.

The target hands over the features of every position it computes and keeps (prefill chunks, and
the accepted positions of each verification). Each round the head catches up on them and drafts
a chain on its own outputs through the one head drafting loop
(:mod:`specfork.speculative.head_runner`).

A chain takes its next token only while the head's probability of the chain so far times its
top probability there stays at or above ``min_confidence`` (it may be empty). Draft tokens come
from the head's reduced vocabulary; their distribution q is scattered into the target's
vocabulary (zero elsewhere) before verification, so a target token the head cannot propose is
still produced with its exact probability.
"""

from __future__ import annotations

import torch

from specfork.engine.sequence import Sequence
from specfork.speculative.head_runner import HeadRunner, HeadState
from specfork.speculative.proposer import Proposal

MAX_PENDING_FEATURES = 256  # positions of the target's features a sequence keeps before catching up


class Eagle3Proposer:
    def __init__(self, head, *, feature_layers: tuple[int, ...], vocab_size: int, num_blocks: int,
                 block_size: int, device: torch.device, min_confidence: float = 0.0, cuda_graphs: bool = False,
                 max_seqs: int = 32, prefix_caching: bool = False) -> None:
        self.drafts = HeadRunner(head, vocab_size=vocab_size, num_blocks=num_blocks, block_size=block_size,
                                 device=device, cuda_graphs=cuda_graphs, max_seqs=max_seqs,
                                 prefix_caching=prefix_caching)
        self.head = head
        self.feature_layers = feature_layers
        self.min_confidence = min_confidence
        self._states: dict[int, HeadState] = {}

    def observe_features(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        self._states.setdefault(seq.seq_id, HeadState()).observe(first_position, features, seq.seq_id)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        states = [self._states.setdefault(s.seq_id, HeadState()) for s in seqs]
        drafted = self.drafts.draft(states, [s.token_ids for s in seqs], num_tokens, [s.params for s in seqs],
                                    [s.generator for s in seqs], min_confidence=self.min_confidence)
        return Proposal.of([d.tokens for d in drafted], [d.probs for d in drafted], self.drafts.vocab_size,
                           self.drafts.device)

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        """The head's rows past the caught-up ones are rewritten next round. A sequence that has
        not drafted for MAX_PENDING_FEATURES positions (k auto decoding plainly, prompt lookup
        proposing) catches up now, so that the features it keeps stay bounded."""
        st = self._states.get(seq.seq_id)
        if (st is not None and st.num_features >= MAX_PENDING_FEATURES and st.ready(len(seq.token_ids))
                and self.drafts.blocks.can_grow(st, len(seq.token_ids) - 1)):
            with torch.inference_mode():
                self.drafts.catch_up([st], [seq.token_ids])

    def release(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is None:
            return
        if seq.finish_reason in ("stop", "length"):
            self._cache_rows(st, seq)
        self.drafts.release(st)

    def _cache_rows(self, st: HeadState, seq: Sequence) -> None:
        """With prefix caching, a finished sequence's head first runs the target's features it
        has not yet run (a round's last accepted tokens; a whole prompt if it never drafted), so
        that a later prompt repeating its tokens (a conversation's next turn) finds the head's rows
        for all of them and the target's blocks can be taken as far. About a row of the head per
        token, 1/15-1/20 of the target's cost; skipped when the cache has no room. Features of
        tokens a stop cut off (computed in the same round or call) are dropped first."""
        context = seq.token_ids
        st.trim(len(context))
        if (not self.drafts.blocks.prefix_caching or not st.num_features or not st.ready(len(context))
                or not self.drafts.blocks.can_grow(st, len(context) - 1)):
            return
        with torch.inference_mode():
            self.drafts.catch_up([st], [context])

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """As far as the head's own cache holds its rows for the same tokens."""
        return self.drafts.cached_rows(seq.token_ids, num_tokens)

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        state = HeadState()
        self.drafts.adopt(state, seq.token_ids, num_tokens)
        self._states[seq.seq_id] = state

    def draft_step_seconds(self) -> float:
        return self.drafts.draft_step_seconds()
