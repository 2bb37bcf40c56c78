"""The SSD drafter: answers speculation requests from its cache (or a backup), then pre-drafts
the next round's speculations for the likeliest verification outcomes.

One round, per sequence (``rec`` is the token the target sampled last, pending in both
caches; P is its position):

1. **Lookup.** The target reports the outcome of its last verification: n drafts accepted and
   the new ``rec``. The cache key is (sequence, n, rec) (``cache.py``). A hit returns the k
   cached tokens and the exact distributions they were drawn from; a miss runs the backup:
   ``jit`` drafts k tokens now through the one drafting loop (only for the rows that missed),
   ``fast`` proposes an n-gram lookup over the sequence (no draft compute; verified as one-hot
   proposals).
2. **Glue.** One causal forward over ``[rec, x1..xk]`` (the speculation just returned) writes
   the trunk KV and gives L_0..L_k, the draft distributions after ``rec, x1..xj``.
3. **Fork** and 4. **tree decode** (``tree.py``): the top-F_j candidates of every L_j each
   decode k tokens; the results go into the cache under (sequence, j, candidate), so the cache
   holds exactly the entries for the next round.

The drafter is a draft model or an EAGLE-3 head. A head reads the target's features: each
request brings those of the positions the target kept since the last one (the prompt's, then
the accepted positions of the verification just done: one round late for the pre-drafting
that ran during that verification, which drafted on the head's own outputs). The glue first
catches up on them, then runs ``x1..xk`` on the head's own outputs, one row each; every branch
starts from the glue's output behind its L_j. A sequence whose features went missing (a
restarted drafter sees none of the earlier ones) gets no drafts from the head: its rounds are
served by the ``fast`` lookup or propose nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch

from specfork.models.eagle3 import Eagle3Head
from specfork.sampling import Draw
from specfork.sampling_params import SamplingParams
from specfork.speculative.draft_runner import DraftRunner, DraftState
from specfork.speculative.head_runner import HeadRunner, HeadState
from specfork.speculative.ngram import NgramIndex
from specfork.speculative.ssd.cache import CachedDraft, SpeculationCache
from specfork.speculative.ssd.messages import DrafterSettings, SpecReply, SpecRequest
from specfork.speculative.ssd.tree import (
    fork_candidates,
    saguaro_reshape,
    tree_decode_paged,
    tree_decode_sdpa,
)


@dataclass
class TrunkState(DraftState):
    """The drafter's view of one sequence. Its KV cache holds the first ``num_cached_tokens`` of
    ``history + last_spec`` (committed tokens, the pending rec last, then the speculation the
    target was last given)."""

    history: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    last_spec: list[int] = field(default_factory=list)
    hit: bool = False
    lookup: NgramIndex = field(default_factory=lambda: NgramIndex(min_n=1, max_n=4))  # the "fast" backup's

    def commit(self, new_tokens: list[int]) -> None:
        """Append the tokens the target committed; KV stays valid for the old history and the
        leading speculated tokens the new ones agree with, never for the new pending rec."""
        agree = 0
        for ours, theirs in zip(self.last_spec, new_tokens[:-1], strict=False):
            if ours != theirs:
                break
            agree += 1
        old = len(self.history)
        self.history.extend(new_tokens)
        self.keep(min(old + agree, len(self.history) - 1))

    def draftable(self) -> bool:
        """Whether the drafter can draft for this sequence now (a draft model always can)."""
        return True


@dataclass
class HeadTrunk(TrunkState, HeadState):
    """A sequence's trunk in an EAGLE-3 head's cache: only its rows computed from the target's
    features stay valid from round to round."""

    def commit(self, new_tokens: list[int]) -> None:
        self.history.extend(new_tokens)
        self.keep(self.clean)

    def draftable(self) -> bool:
        return self.ready(len(self.history))


class DrafterCore:
    """Drafting state and compute; transport-agnostic (the worker process wraps it). ``model``:
    a draft model, or an EAGLE-3 head (:class:`~specfork.models.eagle3.Eagle3Head`)."""

    def __init__(self, model, settings: DrafterSettings, device: torch.device, seed: int = 0) -> None:
        self.settings = settings
        self.device = device
        self.seed = seed
        runner = HeadRunner if isinstance(model, Eagle3Head) else DraftRunner
        if runner is HeadRunner and settings.tree_backend != "fast":
            raise ValueError("an EAGLE-3 head pre-drafts with the 'fast' tree backend only")
        self.drafts = runner(model, vocab_size=settings.vocab_size or model.config.vocab_size,
                             num_blocks=settings.num_blocks, block_size=settings.block_size, device=device)
        self._trunk = HeadTrunk if runner is HeadRunner else TrunkState
        self.max_positions = model.rotary.cos.shape[0]  # the target's context: its RoPE table length
        self.states: dict[int, TrunkState] = {}
        self.cache = SpeculationCache()
        self.pending: list[int] = []  # sequences answered this round, to pre-draft for
        # Saguaro: steer towards the top-(F + 1) tokens, F the largest per-outcome fan-out.
        self._reshape = None
        if settings.saguaro is not None:
            self._reshape = partial(saguaro_reshape, top=max(settings.fanout_hit) + 1, coefficient=settings.saguaro)
        # Counters, plus the seconds spent answering this round and pre-drafting the previous one.
        self.stats = {"requests": 0, "hits": 0, "jit": 0, "fast": 0, "answer_s": 0.0, "prepare_s": 0.0}

    # -- round step 1: answer -------------------------------------------------------------

    def speculate(self, requests: list[SpecRequest]) -> list[SpecReply]:
        started = time.perf_counter()
        replies: dict[int, SpecReply] = {}
        missed: list[SpecRequest] = []
        for req in requests:
            st = self.states.get(req.seq_id)
            if st is None:
                st = self._new_state(req)
            entry = self.cache.lookup(req, st.last_spec)
            st.commit(req.new_tokens)
            if req.features is not None and self.drafts.reads_features:
                st.observe(req.features_from, torch.from_numpy(req.features).to(self.device), req.seq_id)
            st.params = req.params
            st.hit = entry is not None
            self.stats["requests"] += 1
            if entry is not None:
                n = min(req.num_tokens, len(entry.tokens))
                probs = None if entry.probs is None else self.drafts.in_target_vocabulary(entry.probs[:n])
                replies[req.seq_id] = SpecReply(req.seq_id, "hit", entry.tokens[:n], probs)
                self.stats["hits"] += 1
            else:
                missed.append(req)
        self.cache.clear()
        # A head cannot draft for a sequence whose features went missing: the lookup serves it.
        jit_ids = {r.seq_id for r in missed if self.settings.backup == "jit" and self.states[r.seq_id].draftable()}
        jit = [r for r in missed if r.seq_id in jit_ids]
        fast = [r for r in missed if r.seq_id not in jit_ids]
        for kind, reqs in (("jit", jit), ("fast", fast)):
            if reqs:
                replies.update((r.seq_id, r) for r in (self._jit(reqs) if kind == "jit" else self._fast(reqs)))
                self.stats[kind] += len(reqs)
        self.pending = [r.seq_id for r in requests]
        for reply in replies.values():
            self.states[reply.seq_id].last_spec = list(reply.tokens)
        self.stats["answer_s"] = time.perf_counter() - started
        return [replies[r.seq_id] for r in requests]

    def _new_state(self, req: SpecRequest) -> TrunkState:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(hash((self.seed, req.params.seed, req.seq_id)) & 0x7FFF_FFFF_FFFF_FFFF)
        st = self.states[req.seq_id] = self._trunk(params=req.params, generator=gen)
        return st

    def _fast(self, reqs: list[SpecRequest]) -> list[SpecReply]:
        replies = []
        vocab = self.drafts.vocab_size
        for req in reqs:
            st = self.states[req.seq_id]
            tokens = [t for t in st.lookup.propose(st.history, req.num_tokens) if t < vocab]
            probs = None
            if not req.params.greedy:
                probs = torch.zeros(len(tokens), vocab, device=self.device)
                probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
            replies.append(SpecReply(req.seq_id, "fast", tokens, probs))
        return replies

    def _jit(self, reqs: list[SpecRequest]) -> list[SpecReply]:
        """Draft ``num_tokens`` tokens now for these rows only, from their trunks."""
        states = [self.states[r.seq_id] for r in reqs]
        drafted = self.drafts.draft(
            states, [st.history for st in states], [r.num_tokens for r in reqs], [st.params for st in states],
            [st.generator for st in states], self._reshape,
        )
        return [SpecReply(r.seq_id, "jit", d.tokens, d.probs) for r, d in zip(reqs, drafted, strict=True)]

    def _sample(self, logits: torch.Tensor, states: list[TrunkState]) -> Draw:
        return self.drafts.sample(logits, [st.params for st in states], [st.generator for st in states], self._reshape)

    # -- round steps 2-4: pre-draft -----------------------------------------------------

    def prepare_next(self) -> None:
        """Glue, fork and tree-decode for every sequence answered this round."""
        started = time.perf_counter()
        try:
            self._prepare_next()
        finally:
            self.stats["prepare_s"] = time.perf_counter() - started

    def _prepare_next(self) -> None:
        # A branch ends k tokens past the glued speculation; near the end of the context it would
        # run past the RoPE tables, where the target verifies nothing: such sequences are not
        # pre-drafted (a miss drafts what the target asks for, which stays inside the context).
        seq_ids = [i for i in self.pending if i in self.states and self.states[i].draftable()
                   and len(self.states[i].history) + len(self.states[i].last_spec) + self.settings.k
                   < self.max_positions]
        self.pending = []
        if not seq_ids:
            return
        states = [self.states[i] for i in seq_ids]
        # Forward [.., rec, x1..xk] into each trunk: L_0..L_k per state [k + 1, the drafter's columns].
        glued, outs = self.drafts.glue(states, [st.history for st in states], [st.last_spec for st in states])
        branches = []  # (state index, j, candidate)
        for s, (st, logits) in enumerate(zip(states, glued, strict=True)):
            fan = self.settings.fanout_hit if st.hit else self.settings.fanout_miss
            forks = fork_candidates(logits, st.last_spec, fan, st.params, self.drafts.draft_to_target)
            branches.extend((s, j, c) for j, c in forks)
        if not branches:
            return
        if self.settings.tree_backend == "sdpa":
            drafts = tree_decode_sdpa(self.drafts, states, branches, self.settings.k, self._sample)
        else:
            hidden = None if outs is None else torch.cat([outs[s][j : j + 1] for s, j, _ in branches])
            drafts = tree_decode_paged(self.drafts, states, branches, self.settings.k, self._sample, hidden)
        for (s, j, c), (tokens, probs) in zip(branches, drafts, strict=True):
            self.cache.put(seq_ids[s], j, c, CachedDraft(tokens, probs))

    def release(self, seq_id: int) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.drafts.release(st)
        self.cache.release(seq_id)
