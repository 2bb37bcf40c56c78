"""Fork and tree decode: the SSD drafter's pre-drafting for the likeliest verification outcomes.

**Fork.** For every outcome j the top-F_j tokens of L_j (the draft distribution after
``rec, x1..xj``), excluding x_{j+1} (a rejected token is never the correction: greedily argmax
p != x_{j+1}, and when sampling the residual is 0 there), are the candidate next ``rec``
tokens: branch (j, c) continues ``rec, x1..xj, c`` with c at position P + j + 1.

**Tree decode.** All branches decode k tokens together, k batched forwards, each branch seeing
only the shared prefix and its own tokens. Two attention backends (same speculations, tested
against each other):

* ``sdpa`` (the reference): branch tokens live in a scratch region after the glue, slot
  ``P + k + 1 + d * M + f`` for branch f at depth d (M branches), with an explicit tree mask;
  attention is the masked SDPA path.
* ``fast``: every branch gets its own block table sharing the trunk's full blocks; the one
  partly filled block at its fork point is copied, so a branch is an ordinary causal sequence
  and the native paged-attention decode kernel runs it with no mask. It runs draft models and
  EAGLE-3 heads alike (a head's branch carries its hidden from row to row).

**Saguaro sampling** (temperature > 0, coefficient C in (0, 1]): draws use q'(t) proportional
to C * q(t) on the top-(F + 1) tokens of q and q(t) elsewhere, which steers the verifier's
residual towards cached branches; q' itself is what is returned with the token, so
verification stays exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specfork.sampling import Draw, filtered_probs
from specfork.sampling_params import SamplingParams
from specfork.speculative.draft_runner import DraftRunner
from specfork.speculative.head_runner import HeadRunner

Branch = tuple[int, int, int]  # (index of its sequence's trunk, outcome j, candidate token)
Sampler = Callable[[torch.Tensor, list], Draw]  # (the drafter's logits [N, columns], trunk of each row) -> draw
Drafts = list[tuple[list[int], torch.Tensor | None]]  # per branch: k tokens and their q (None if greedy), over
# the drafter's columns (an EAGLE-3 head's draft vocabulary)


def saguaro_reshape(q: torch.Tensor, top: int, coefficient: float) -> torch.Tensor:
    """q'(t) proportional to C q(t) for the top-(``top``) tokens of each row, q(t) elsewhere."""
    if coefficient == 1.0 or top <= 0:
        return q
    idx = q.topk(min(top, q.shape[-1]), dim=-1).indices
    scaled = q.clone()
    scaled.scatter_(-1, idx, q.gather(-1, idx) * coefficient)
    return scaled / scaled.sum(dim=-1, keepdim=True)


def fork_candidates(logits: torch.Tensor, spec: list[int], fan: tuple[int, ...], params: SamplingParams,
                    column_ids: list[int] | None = None) -> list[tuple[int, int]]:
    """Branches (j, candidate), j-major: for each outcome j = 0..len(spec), the top-F_j tokens
    of L_j (``logits[j]``) excluding spec[j] (the token that was itself speculated there).
    For sampling requests candidates are ranked by the filtered draft distribution and tokens it
    gives probability 0 are skipped. ``column_ids``: the target id of each column of ``logits``
    (an EAGLE-3 head's draft vocabulary; None: the column is the id)."""
    out = []
    scores = logits if params.greedy else filtered_probs(logits, [params] * logits.shape[0])
    for j in range(len(spec) + 1):
        f = fan[j] if j < len(fan) else 0
        if f <= 0:
            continue
        excluded = spec[j] if j < len(spec) else None
        vals, idx = scores[j].topk(min(f + 1, scores.shape[1]))  # one more, in case the excluded is among them
        taken = 0
        for v, c in zip(vals.tolist(), idx.tolist(), strict=True):
            token = c if column_ids is None else column_ids[c]
            if taken == f or v == float("-inf") or (not params.greedy and v <= 0.0):
                break
            if token == excluded:
                continue
            out.append((j, token))
            taken += 1
    return out


class _Collector:
    """The k tokens (and q rows) each branch draws, depth by depth."""

    def __init__(self, n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.probs: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def add(self, branch_of_row: list[int], draw: Draw) -> None:
        for row, b in enumerate(branch_of_row):
            self.tokens[b].append(draw.tokens[row])
            q = draw.q_of(row)
            if q is not None:
                self.probs[b].append(q)

    def result(self) -> Drafts:
        return [(t, torch.stack(p) if p else None) for t, p in zip(self.tokens, self.probs, strict=True)]


@dataclass
class _BranchTable:
    """A virtual sequence for the paged backend: its own block table."""

    block_table: list[int]


def tree_decode_paged(drafts: DraftRunner | HeadRunner, trunks: list, branches: list[Branch], k: int,
                      sampler: Sampler, hidden: torch.Tensor | None = None) -> Drafts:
    """The ``fast`` backend: one block table per branch, the fork block copied. For an EAGLE-3
    head ``hidden`` [branches, d] is what each branch's first row reads (the glue's output
    behind L_j); every further row reads the row before it."""
    bs, runner = drafts.blocks.block_size, drafts.runner
    virtual, owned, copies, starts = [], [], [], []
    try:
        for s, j, _c in branches:
            trunk = trunks[s]
            # The row that reads the candidate (at P + j + 1, rec at P = len(history) - 1).
            start = len(trunk.history) + j + drafts.row_offset
            shared = start // bs
            fresh = drafts.blocks.allocate(-(-(start + k) // bs) - shared)
            owned.extend(fresh)
            if start % bs:  # the fork point is inside a trunk block: copy it
                copies.append((trunk.block_table[shared], fresh[0]))
            virtual.append(_BranchTable(trunk.block_table[:shared] + fresh))
            starts.append(start)
        if copies:
            src, dst = (torch.tensor(x, dtype=torch.long, device=drafts.device) for x in zip(*copies, strict=True))
            for cache in runner.kv_caches:
                cache.index_copy_(1, dst, cache.index_select(1, src))
        row_trunks = [trunks[s] for s, _, _ in branches]
        feeds = [c for _, _, c in branches]
        out = _Collector(len(branches))
        every = list(range(len(branches)))
        for d in range(k):
            logits, hidden = drafts.decode_step(virtual, [p + d for p in starts], feeds, hidden)
            draw = sampler(logits, row_trunks)
            out.add(every, draw)
            feeds = draw.tokens
    finally:
        drafts.blocks.release_blocks(owned)
    return out.result()


def tree_decode_sdpa(drafts: DraftRunner, trunks: list, branches: list[Branch], k: int, sampler: Sampler) -> Drafts:
    """The ``sdpa`` reference backend: scratch slots after the glue and an explicit tree mask."""
    by_trunk: dict[int, list[int]] = {}
    for b, (s, _, _) in enumerate(branches):
        by_trunk.setdefault(s, []).append(b)
    order = sorted(by_trunk)
    scratch = {}
    for s in order:
        trunk = trunks[s]
        scratch[s] = len(trunk.history) + len(trunk.last_spec)  # the first slot after the glue
        drafts.blocks.grow(trunk, scratch[s] + k * len(by_trunk[s]))
    feeds = {b: c for b, (_, _, c) in enumerate(branches)}
    flat = [b for s in order for b in by_trunk[s]]
    row_trunks = [trunks[branches[b][0]] for b in flat]
    out = _Collector(len(branches))
    try:
        for d in range(k):
            mask, layout, tokens = _tree_inputs(trunks, branches, by_trunk, order, scratch, feeds, d, drafts.device)
            logits = drafts.runner.forward(
                [trunks[s] for s in order], [0] * len(order), tokens, list(range(len(flat))), mask,
                decode=False, layout=layout,
            )
            draw = sampler(logits[:, : drafts.vocab_size], row_trunks)
            out.add(flat, draw)
            for r, b in enumerate(flat):
                feeds[b] = draw.tokens[r]
    finally:
        for s in order:
            drafts.blocks.shrink(trunks[s], trunks[s].num_cached_tokens)
    return out.result()


def _tree_inputs(trunks, branches, by_trunk, order, scratch, feeds, d: int, device: torch.device):
    """Depth ``d`` of the sdpa backend: the tree mask, (positions, slots) and tokens per trunk."""
    width = max(len(by_trunk[s]) for s in order)
    k_max = max(scratch[s] + (d + 1) * len(by_trunk[s]) for s in order)
    mask = torch.zeros(len(order), width, k_max, dtype=torch.bool, device=device)
    positions, slots, tokens = [], [], []
    for row, s in enumerate(order):
        members = by_trunk[s]
        m = len(members)
        pos_row, slot_row, tok_row = [], [], []
        for f, b in enumerate(members):
            start = len(trunks[s].history) + branches[b][1]
            pos_row.append(start + d)
            slot_row.append(scratch[s] + d * m + f)
            tok_row.append(feeds[b])
            mask[row, f, :start] = True  # prefix, rec and x1..xj
            for e in range(d + 1):
                mask[row, f, scratch[s] + e * m + f] = True
        positions.append(pos_row)
        slots.append(slot_row)
        tokens.append(tok_row)
    return mask, (positions, slots), tokens
