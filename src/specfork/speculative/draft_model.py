"""Draft-model proposer (SD): a smaller checkpoint with the target's vocabulary drafts k tokens
per round through the one drafting loop (:mod:`specfork.speculative.draft_runner`)."""

from __future__ import annotations

import torch

from specfork.engine.sequence import Sequence
from specfork.speculative.draft_runner import DraftRunner, DraftState
from specfork.speculative.proposer import Proposal, ReadsNoFeatures


class DraftModelProposer(ReadsNoFeatures):
    def __init__(self, draft_model, *, vocab_size: int, num_blocks: int, block_size: int,
                 device: torch.device, cuda_graphs: bool = False, max_seqs: int = 32, max_rows: int = 9) -> None:
        self.drafts = DraftRunner(draft_model, vocab_size=vocab_size, num_blocks=num_blocks, block_size=block_size,
                                  device=device, cuda_graphs=cuda_graphs, max_seqs=max_seqs, max_rows=max_rows)
        self._states: dict[int, DraftState] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        states = [self._states.setdefault(s.seq_id, DraftState()) for s in seqs]
        drafted = self.drafts.draft(
            states, [s.token_ids for s in seqs], num_tokens, [s.params for s in seqs], [s.generator for s in seqs]
        )
        return Proposal.of([d.tokens for d in drafted], [d.probs for d in drafted], self.drafts.vocab_size,
                           self.drafts.device)

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        st = self._states.get(seq.seq_id)
        if st is not None:
            # The draft's KV is valid for the committed tokens before the new correction/bonus.
            st.keep(len(seq) - 1)

    def draft_step_seconds(self) -> float:
        """Median time of one draft forward (one token after a 64-token context)."""
        from specfork.speculative.auto_k import measure_forward

        return measure_forward(self.drafts.runner, self.drafts.blocks, 1)

    def release(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self.drafts.release(st)
