"""The SSD drafter: answers speculation requests from its cache (or a backup), then pre-drafts
the next round's speculations for the likeliest verification outcomes.

One round, per sequence (``rec`` is the token the target sampled last, pending in both
caches; P is its position):

1. **Lookup.** The target reports the outcome of its last verification: n drafts accepted and
   the new ``rec``. The cache key is (sequence, n, rec). A hit returns the k cached tokens and
   the exact distributions they were drawn from; a miss runs the backup: ``jit`` drafts k
   tokens now (only for the rows that missed), ``fast`` proposes an n-gram lookup over the
   sequence (no draft compute; verified as one-hot proposals).
2. **Glue.** One causal forward over ``[rec, x1..xk]`` (the speculation just returned) writes
   the trunk KV and gives L_0..L_k, the draft distributions after ``rec, x1..xj``.
3. **Fork.** For every outcome j the top-F_j tokens of L_j, excluding x_{j+1} (a rejected token
   is never the correction: greedily argmax p != x_{j+1}, and when sampling the residual is 0
   there), are the candidate next ``rec`` tokens: branch (j, c) continues
   ``rec, x1..xj, c`` with c at position P + j + 1.
4. **Tree decode.** All branches decode k tokens together, k batched forwards, each branch
   seeing only the shared prefix and its own tokens; the results go into the cache under
   (sequence, j, c). The cache holds exactly the entries for the next round.

Two tree attention backends (same speculations, tested against each other):

* ``sdpa`` (the reference): branch tokens live in a scratch region after the glue, slot
  ``P + k + 1 + d * M + f`` for branch f at depth d (M branches), with an explicit tree mask;
  attention is the masked SDPA path.
* ``fast``: every branch gets its own block table sharing the trunk's full blocks; the
  one partly filled block at its fork point is copied, so a branch is an ordinary causal
  sequence and the native paged-attention decode kernel runs it with no mask.

Saguaro sampling (temperature > 0, ``saguaro`` = C in (0, 1]): tree and jit draws use
q'(t) proportional to C * q(t) on the top-(F + 1) tokens of q and q(t) elsewhere, which steers
the verifier's residual towards cached branches; q' itself is what is returned with the token,
so verification stays exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specfork.engine.block_manager import BlockManager
from specfork.engine.model_runner import ModelRunner
from specfork.engine.step import sampling_tensors
from specfork.layers.sampler import logits_to_probs, sample_from_probs
from specfork.sampling_params import SamplingParams
from specfork.speculative.ngram import ngram_lookup


@dataclass(frozen=True, slots=True)
class DrafterSettings:
    k: int
    fanout_hit: tuple[int, ...]
    fanout_miss: tuple[int, ...]
    backup: str = "jit"
    tree_backend: str = "fast"
    saguaro: float | None = None
    block_size: int = 16
    num_blocks: int = 4096
    vocab_size: int = 0  # the target's (draft rows beyond it are never proposed)


@dataclass(slots=True)
class SpecRequest:
    """One sequence's part of a speculation request.

    ``new_tokens``: tokens committed since this sequence's previous request, the new ``rec``
    last (the whole prompt plus the first sampled token on the first request).
    ``num_accepted``: n of the previous verification (None on the first request).
    """

    seq_id: int
    new_tokens: list[int]
    num_accepted: int | None
    params: SamplingParams
    num_tokens: int


@dataclass(slots=True)
class SpecReply:
    seq_id: int
    source: str  # "hit", "jit" or "fast"
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] q of each token; None for greedy requests


@dataclass
class TrunkState:
    """The drafter's view of one sequence: what is committed and what its KV cache holds."""

    history: list[int]  # committed tokens, the pending rec last
    params: SamplingParams
    generator: torch.Generator
    kv_tokens: list[int] = field(default_factory=list)  # token at each trunk position with valid KV
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # len(kv_tokens) (BlockManager bookkeeping)
    last_spec: list[int] = field(default_factory=list)
    hit: bool = False

    def valid_prefix(self) -> int:
        """Trunk positions whose KV matches the history, never including the pending rec."""
        limit = min(len(self.kv_tokens), len(self.history) - 1)
        n = 0
        while n < limit and self.kv_tokens[n] == self.history[n]:
            n += 1
        return n


@dataclass
class _Branch:
    """A virtual sequence for the paged tree backend: its own block table."""

    block_table: list[int]
    num_cached_tokens: int = 0


def saguaro_reshape(q: torch.Tensor, top: int, coefficient: float) -> torch.Tensor:
    """q'(t) proportional to C q(t) for the top-(``top``) tokens of each row, q(t) elsewhere."""
    if coefficient == 1.0 or top <= 0:
        return q
    idx = q.topk(min(top, q.shape[-1]), dim=-1).indices
    scaled = q.clone()
    scaled.scatter_(-1, idx, q.gather(-1, idx) * coefficient)
    return scaled / scaled.sum(dim=-1, keepdim=True)


class DrafterCore:
    """Drafting state and compute; transport-agnostic (the worker process wraps it)."""

    def __init__(self, model, settings: DrafterSettings, device: torch.device, seed: int = 0) -> None:
        self.settings = settings
        self.device = device
        self.seed = seed
        self.runner = ModelRunner(model, num_blocks=settings.num_blocks, block_size=settings.block_size, device=device)
        self.blocks = BlockManager(settings.num_blocks, settings.block_size)
        self.vocab_size = settings.vocab_size or model.config.vocab_size
        self.states: dict[int, TrunkState] = {}
        self.cache: dict[tuple[int, int, int], tuple[list[int], torch.Tensor | None]] = {}
        self.pending: list[int] = []  # sequences answered this round, to pre-draft for
        # Counters, plus the seconds spent answering this round and pre-drafting the previous one.
        self.stats = {"requests": 0, "hits": 0, "jit": 0, "fast": 0, "answer_s": 0.0, "prepare_s": 0.0}

    # -- round step 1: answer -------------------------------------------------------------

    def speculate(self, requests: list[SpecRequest]) -> list[SpecReply]:
        started = time.perf_counter()
        replies: list[SpecReply | None] = []
        missed: list[int] = []
        for req in requests:
            st = self._update(req)
            key = (req.seq_id, req.num_accepted, st.history[-1]) if req.num_accepted is not None else None
            entry = self.cache.get(key) if key is not None and self._consistent(st, req) else None
            self.stats["requests"] += 1
            if entry is not None:
                tokens, probs = entry
                n = min(req.num_tokens, len(tokens))
                replies.append(SpecReply(req.seq_id, "hit", tokens[:n], None if probs is None else probs[:n]))
                st.hit = True
                self.stats["hits"] += 1
            else:
                replies.append(None)
                missed.append(len(replies) - 1)
                st.hit = False
        self.cache.clear()
        if missed:
            reqs = [requests[i] for i in missed]
            backup = self._jit(reqs) if self.settings.backup == "jit" else self._fast(reqs)
            for i, reply in zip(missed, backup, strict=True):
                replies[i] = reply
            self.stats[self.settings.backup] += len(missed)
        self.pending = [r.seq_id for r in requests]
        for reply in replies:
            self.states[reply.seq_id].last_spec = list(reply.tokens)
        self.stats["answer_s"] = time.perf_counter() - started
        return replies  # type: ignore[return-value]

    def _update(self, req: SpecRequest) -> TrunkState:
        st = self.states.get(req.seq_id)
        if st is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(hash((self.seed, req.params.seed, req.seq_id)) & 0x7FFF_FFFF_FFFF_FFFF)
            st = self.states[req.seq_id] = TrunkState(history=[], params=req.params, generator=gen)
        st.history.extend(req.new_tokens)
        st.params = req.params
        return st

    @staticmethod
    def _consistent(st: TrunkState, req: SpecRequest) -> bool:
        """The reported outcome matches what was speculated: the accepted tokens are the
        first n of the last speculation (else the cache entries are for another context)."""
        n = req.num_accepted
        return n is not None and len(req.new_tokens) == n + 1 and req.new_tokens[:n] == st.last_spec[:n]

    # -- backups ------------------------------------------------------------------------------

    def _fast(self, reqs: list[SpecRequest]) -> list[SpecReply]:
        replies = []
        for req in reqs:
            st = self.states[req.seq_id]
            tokens = [t for t in ngram_lookup(st.history, min_n=1, max_n=4, k=req.num_tokens) if t < self.vocab_size]
            probs = None
            if not req.params.greedy:
                probs = torch.zeros(len(tokens), self.vocab_size, device=self.device)
                probs[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
            replies.append(SpecReply(req.seq_id, "fast", tokens, probs))
        return replies

    def _jit(self, reqs: list[SpecRequest]) -> list[SpecReply]:
        """Draft ``num_tokens`` tokens now for these rows only, from their trunks."""
        states = [self.states[r.seq_id] for r in reqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        active = [i for i, r in enumerate(reqs) if r.num_tokens > 0]
        for i in active:
            st = states[i]
            self._sync_trunk_length(st, len(st.history) + reqs[i].num_tokens)
        while active:
            feeds, starts = [], []
            for i in active:
                st = states[i]
                valid = st.valid_prefix() if not tokens[i] else len(st.kv_tokens)
                known = st.history + tokens[i]
                del st.kv_tokens[valid:]
                feeds.append(known[valid:])
                starts.append(valid)
            rows = _last_rows(feeds)
            logits = self.runner.forward([states[i] for i in active], starts, feeds, rows, decode=False)
            for i, f in zip(active, feeds, strict=True):
                states[i].kv_tokens.extend(f)
            drawn, q = self._draw(logits[:, : self.vocab_size], [states[i] for i in active], [0] * len(active))
            for row, i in enumerate(active):
                tokens[i].append(drawn[row])
                if q is not None and not states[i].params.greedy:
                    probs[i].append(q[row])
            active = [i for i in active if len(tokens[i]) < reqs[i].num_tokens]
        return [
            SpecReply(r.seq_id, "jit", tokens[i], torch.stack(probs[i]) if probs[i] else None)
            for i, r in enumerate(reqs)
        ]

    # -- sampling -------------------------------------------------------------------------

    def _draw(self, logits: torch.Tensor, states: list[TrunkState], tops: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """One token per row: argmax for greedy requests; else a draw from the request's filtered
        distribution, Saguaro-reshaped on its top-``tops[i]`` tokens when enabled. Returns the
        tokens and the distributions sampled rows were drawn from ([N, V], greedy rows unused)."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, s in enumerate(states) if not s.params.greedy]
        if not sampled:
            return tokens.tolist(), None
        idx = torch.tensor(sampled, device=logits.device)
        rows = [states[i] for i in sampled]
        q = logits_to_probs(logits.index_select(0, idx), *sampling_tensors(rows, logits.device))
        c = self.settings.saguaro
        if c is not None:
            q = torch.stack([saguaro_reshape(q[r : r + 1], tops[i] + 1, c)[0] for r, i in enumerate(sampled)])
        tokens[idx] = sample_from_probs(q, [s.generator for s in rows])
        full = torch.zeros(len(states), logits.shape[-1], device=logits.device)
        full[idx] = q
        return tokens.tolist(), full

    # -- round steps 2-4: pre-draft -----------------------------------------------------

    def prepare_next(self) -> None:
        """Glue, fork and tree-decode for every sequence answered this round."""
        started = time.perf_counter()
        try:
            self._prepare_next()
        finally:
            self.stats["prepare_s"] = time.perf_counter() - started

    def _prepare_next(self) -> None:
        seq_ids = [i for i in self.pending if i in self.states]
        self.pending = []
        if not seq_ids:
            return
        states = [self.states[i] for i in seq_ids]
        glue = self._glue(states)
        branches = []  # (state index, j, candidate)
        for s, (st, logits) in enumerate(zip(states, glue, strict=True)):
            fan = self.settings.fanout_hit if st.hit else self.settings.fanout_miss
            for j, c in fork_candidates(logits, st.last_spec, fan, st.params):
                branches.append((s, j, c))
        if not branches:
            return
        if self.settings.tree_backend == "sdpa":
            results = self._tree_sdpa(states, branches)
        else:
            results = self._tree_paged(states, branches)
        for (s, j, c), (tokens, probs) in zip(branches, results, strict=True):
            self.cache[(seq_ids[s], j, c)] = (tokens, probs)

    def _glue(self, states: list[TrunkState]) -> list[torch.Tensor]:
        """Forward [.., rec, x1..xk] into each trunk; logits L_0..L_k per state [k + 1, V]."""
        feeds, starts, counts = [], [], []
        for st in states:
            valid = st.valid_prefix()
            del st.kv_tokens[valid:]
            known = st.history + st.last_spec
            self._sync_trunk_length(st, len(known))
            feeds.append(known[valid:])
            starts.append(valid)
            counts.append(len(st.last_spec) + 1)
        rows, offset = [], 0
        for f, n in zip(feeds, counts, strict=True):
            offset += len(f)
            rows.extend(range(offset - n, offset))
        logits = self.runner.forward(states, starts, feeds, rows, decode=False)[:, : self.vocab_size]
        for st, f in zip(states, feeds, strict=True):
            st.kv_tokens.extend(f)
            st.num_cached_tokens = len(st.kv_tokens)
        return list(logits.split(counts))

    def _sync_trunk_length(self, st: TrunkState, num_tokens: int) -> None:
        self.blocks.grow(st, num_tokens)

    def _tree_paged(self, states, branches) -> list[tuple[list[int], torch.Tensor | None]]:
        k, bs = self.settings.k, self.settings.block_size
        virtual: list[_Branch] = []
        owned: list[int] = []
        copies_src, copies_dst, starts = [], [], []
        try:
            for s, j, _c in branches:
                st = states[s]
                start = len(st.history) + j  # the candidate's position (rec is at len(history) - 1)
                shared = start // bs
                fresh = self.blocks.allocate(-(-(start + k) // bs) - shared)
                owned.extend(fresh)
                if start % bs:  # the fork point is inside a trunk block: copy it
                    copies_src.append(st.block_table[shared])
                    copies_dst.append(fresh[0])
                virtual.append(_Branch(block_table=st.block_table[:shared] + fresh))
                starts.append(start)
            if copies_src:
                src = torch.tensor(copies_src, dtype=torch.long, device=self.device)
                dst = torch.tensor(copies_dst, dtype=torch.long, device=self.device)
                for cache in self.runner.kv_caches:
                    cache.index_copy_(1, dst, cache.index_select(1, src))
            rows_states = [states[s] for s, _, _ in branches]
            tops = [self._saguaro_top() for _ in rows_states]
            feeds = [c for _, _, c in branches]
            out_tokens: list[list[int]] = [[] for _ in branches]
            out_probs: list[list[torch.Tensor]] = [[] for _ in branches]
            for d in range(k):
                logits = self.runner.forward(
                    virtual, [p + d for p in starts], [[t] for t in feeds], list(range(len(branches))), decode=True
                )[:, : self.vocab_size]
                drawn, q = self._draw(logits, rows_states, tops)
                for b, t in enumerate(drawn):
                    out_tokens[b].append(t)
                    if q is not None and not rows_states[b].params.greedy:
                        out_probs[b].append(q[b])
                feeds = drawn
        finally:
            self.blocks.release_blocks(owned)
        return [(t, torch.stack(p) if p else None) for t, p in zip(out_tokens, out_probs, strict=True)]

    def _saguaro_top(self) -> int:
        """F for the Saguaro reshape: the largest per-outcome fan-out (the top-F tokens of a
        draft distribution are the cached branches it steers the residual towards)."""
        return max(self.settings.fanout_hit)

    def _tree_sdpa(self, states, branches) -> list[tuple[list[int], torch.Tensor | None]]:
        k = self.settings.k
        by_state: dict[int, list[int]] = {}
        for b, (s, _, _) in enumerate(branches):
            by_state.setdefault(s, []).append(b)
        order = sorted(by_state)
        group = [by_state[s] for s in order]
        width = max(len(g) for g in group)
        scratch = {}
        for s in order:
            st = states[s]
            scratch[s] = len(st.history) + len(st.last_spec)  # the first slot after the glue
            self.blocks.grow(st, scratch[s] + k * len(by_state[s]))
        feeds = {b: c for b, (_, _, c) in enumerate(branches)}
        out_tokens: list[list[int]] = [[] for _ in branches]
        out_probs: list[list[torch.Tensor]] = [[] for _ in branches]
        try:
            for d in range(k):
                k_max = max(scratch[s] + (d + 1) * len(by_state[s]) for s in order)
                mask = torch.zeros(len(order), width, k_max, dtype=torch.bool, device=self.device)
                positions, slots, tokens = [], [], []
                for row, s in enumerate(order):
                    st, members = states[s], by_state[s]
                    m = len(members)
                    pos_row, slot_row, tok_row = [], [], []
                    for f, b in enumerate(members):
                        _, j, _ = branches[b]
                        start = len(st.history) + j
                        pos_row.append(start + d)
                        slot_row.append(scratch[s] + d * m + f)
                        tok_row.append(feeds[b])
                        mask[row, f, : start] = True  # prefix, rec and x1..xj
                        for e in range(d + 1):
                            mask[row, f, scratch[s] + e * m + f] = True
                    positions.append(pos_row)
                    slots.append(slot_row)
                    tokens.append(tok_row)
                flat_rows = list(range(sum(len(t) for t in tokens)))
                logits = self.runner.forward(
                    [states[s] for s in order], [0] * len(order), tokens, flat_rows, mask,
                    decode=False, layout=(positions, slots),
                )[:, : self.vocab_size]
                flat = [b for s in order for b in by_state[s]]
                rows_states = [states[branches[b][0]] for b in flat]
                tops = [self._saguaro_top() for _ in rows_states]
                drawn, q = self._draw(logits, rows_states, tops)
                for r, b in enumerate(flat):
                    out_tokens[b].append(drawn[r])
                    feeds[b] = drawn[r]
                    if q is not None and not rows_states[r].params.greedy:
                        out_probs[b].append(q[r])
        finally:
            for s in order:
                self.blocks.shrink(states[s], len(states[s].kv_tokens))
        return [(t, torch.stack(p) if p else None) for t, p in zip(out_tokens, out_probs, strict=True)]

    def release(self, seq_id: int) -> None:
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.blocks.free(st)
        for key in [key for key in self.cache if key[0] == seq_id]:
            del self.cache[key]


def fork_candidates(logits: torch.Tensor, spec: list[int], fan: tuple[int, ...], params: SamplingParams) -> list[tuple[int, int]]:
    """Branches (j, candidate), j-major: for each outcome j = 0..len(spec), the top-F_j tokens
    of L_j (``logits[j]``) excluding spec[j] (the token that was itself speculated there).
    For sampling requests candidates are ranked by the filtered draft distribution and tokens it
    gives probability 0 are skipped."""
    out = []
    scores = logits.clone()
    if not params.greedy:
        temp = torch.full((logits.shape[0],), params.temperature, device=logits.device)
        top_k = torch.full((logits.shape[0],), params.top_k, dtype=torch.long, device=logits.device)
        top_p = torch.full((logits.shape[0],), params.top_p, device=logits.device)
        scores = logits_to_probs(logits, temp, top_k, top_p)
    for j in range(len(spec) + 1):
        f = fan[j] if j < len(fan) else 0
        if f <= 0:
            continue
        row = scores[j].clone()
        if j < len(spec):
            row[spec[j]] = float("-inf")
        vals, idx = row.topk(min(f, row.shape[0]))
        for v, c in zip(vals.tolist(), idx.tolist(), strict=True):
            if v == float("-inf") or (not params.greedy and v <= 0.0):
                continue
            out.append((j, c))
    return out


def _last_rows(feeds: list[list[int]]) -> list[int]:
    rows, offset = [], 0
    for f in feeds:
        offset += len(f)
        rows.append(offset - 1)
    return rows
