"""Prompt lookup first, the draft elsewhere (SD): where the context's last n tokens occurred
earlier, propose what followed them (:class:`specfork.speculative.ngram.PromptLookup`, n from
``max_n`` down to ``min_n``), else, with a corpus, what followed them in the target's earlier
responses (:mod:`specfork.speculative.corpus`); every other sequence of the round is drafted by
the wrapped proposer (a draft model or an EAGLE-3 head).

Why: on code and on answers that quote their prompt the target copies whole spans, which a
lookup proposes exactly and a small draft often misses; elsewhere the draft still proposes.

Exactness: which source proposes for a sequence depends on its tokens alone, never on a random
draw, and each proposal carries the distribution it came from: the draft's q, or one-hot for a
lookup (a deterministic proposal). Verification is then exact for either.

The wrapped proposer keeps seeing every kept position (the target's features, the accepted
counts), so it catches up over lookup rounds as over its own: a head runs the new features
before its next chain, a draft model feeds the uncached tokens.
"""

from __future__ import annotations

import torch

from specfork.config import DEFAULT_CORPUS_TOKENS
from specfork.engine.sequence import Sequence
from specfork.speculative.corpus import LookupCorpus
from specfork.speculative.ngram import PromptLookup
from specfork.speculative.proposer import Proposal, Proposer


class LookupFirstProposer:
    def __init__(self, draft: Proposer, *, min_n: int, max_n: int, corpus: LookupCorpus | None = None,
                 corpus_tokens: int = DEFAULT_CORPUS_TOKENS) -> None:
        self.draft = draft
        self.lookup = PromptLookup(min_n=min_n, max_n=max_n, corpus=corpus, corpus_tokens=corpus_tokens)
        self.feature_layers = draft.feature_layers

    def observe_features(self, seq: Sequence, first_position: int, features: torch.Tensor) -> None:
        self.draft.observe_features(seq, first_position, features)

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposal:
        found = [self.lookup.propose(s, k) for s, k in zip(seqs, num_tokens, strict=True)]
        tokens = [t for t, _ in found]
        rest = [i for i, (t, k) in enumerate(zip(tokens, num_tokens, strict=True)) if not t and k > 0]
        drafted_rows = set(rest)
        sources = [source or ("draft" if i in drafted_rows else None) for i, (_, source) in enumerate(found)]
        if not rest:
            return Proposal(tokens, None, sources)
        drafted = self.draft.propose([seqs[i] for i in rest], [num_tokens[i] for i in rest])
        for j, i in enumerate(rest):
            tokens[i] = drafted.tokens[j]
        if drafted.probs is None:  # every row deterministic or greedy
            return Proposal(tokens, None, sources)
        probs = torch.zeros(len(seqs), max(len(t) for t in tokens), drafted.probs.shape[-1],
                            device=drafted.probs.device)
        for i, t in enumerate(tokens):
            if t and i not in drafted_rows:  # a lookup: one-hot q
                probs[i, torch.arange(len(t), device=probs.device), torch.tensor(t, device=probs.device)] = 1.0
        for j, i in enumerate(rest):
            n = len(tokens[i])
            probs[i, :n] = drafted.probs[j, :n]
        return Proposal(tokens, probs, sources)

    def accepted(self, seq: Sequence, num_accepted: int) -> None:
        self.draft.accepted(seq, num_accepted)

    def release(self, seq: Sequence) -> None:
        self.lookup.release(seq)
        self.draft.release(seq)

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        return self.draft.usable_prefix(seq, num_tokens)  # the lookup reads tokens only

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        self.draft.adopt_prefix(seq, num_tokens)

    def draft_step_seconds(self) -> float:
        return self.draft.draft_step_seconds()
