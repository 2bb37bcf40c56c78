"""The EAGLE-3 head's drafting core: its paged KV cache, the target's features it has not run
yet, and the one head drafting loop. SD's proposer and SSD's drafter (just-in-time drafts, the
glue and the tree decode) all draft through it.

Rows. The head's row t reads the hidden at position t (the target's features there, projected,
or the head's own output at row t - 1) and the token at t + 1; its output predicts the token
at t + 2. A sequence of N tokens (the last one pending: sampled, not yet run by the target) needs
rows 0..N-2 from the target's features; the target computes them as it goes, so they arrive
in order and are run ("caught up") before each round. Row N-2 predicts the first draft token;
each further draft token is one row on the head's own output. Rows past the caught-up ones are
written with stand-ins and rewritten once the target's features for them exist.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specfork.engine.block_manager import BlockManager
from specfork.engine.model_runner import ModelRunner
from specfork.sampling import Draw, Reshape, sample
from specfork.sampling_params import SamplingParams
from specfork.speculative.draft_runner import Drafted, DraftState, last_rows

logger = logging.getLogger(__name__)


@dataclass
class HeadState(DraftState):
    """One sequence in the head's cache. Rows below ``clean`` were computed from the target's
    features (``last_out``: the head's output at row ``clean - 1``); ``features`` are the
    target's features of the positions from ``clean`` on, in order, not yet run."""

    clean: int = 0
    last_out: torch.Tensor | None = None
    last_logits: torch.Tensor | None = None  # the head's draft-vocabulary logits behind last_out
    features: list[torch.Tensor] = field(default_factory=list)
    num_features: int = 0
    broken: bool = False  # features went missing: the sequence gets no drafts from the head

    def observe(self, first_position: int, features: torch.Tensor, seq_id: int) -> None:
        """The target's features of positions ``first_position...`` (they must follow the last ones)."""
        if self.broken or not len(features):
            return
        if first_position != self.clean + self.num_features:
            # A head taking over sequences in flight (SSD's in-process fallback) never saw their
            # first features: expected, so said quietly; a gap later on is a fault.
            joined_late = self.clean == 0 and self.num_features == 0
            logger.log(logging.DEBUG if joined_late else logging.WARNING,
                       "EAGLE-3 head: features of sequence %d arrived out of order (position %d, expected %d); "
                       "it gets no more drafts", seq_id, first_position, self.clean + self.num_features)
            self.broken = True
            return
        self.features.append(features)
        self.num_features += len(features)

    def ready(self, context_len: int) -> bool:
        """Whether every row a round needs (all but the pending token's) can come from the
        target's features, run already or waiting."""
        caught_up = self.num_features > 0 or self.last_out is not None
        return not self.broken and caught_up and self.clean + self.num_features == context_len - 1

    def trim(self, context_len: int) -> None:
        """Drop the waiting features of positions past ``context_len - 1``: tokens the target
        computed and a stop then cut off (EOS or a stop string inside a round or a call of several
        decode steps), so that what remains is ``ready`` for the context kept."""
        excess = self.clean + self.num_features - (context_len - 1)
        if excess <= 0 or excess > self.num_features:
            return
        rows = _joined(self.features)[: self.num_features - excess] if self.features else None
        self.features = [rows] if rows is not None and len(rows) else []
        self.num_features -= excess

    def take_features(self) -> torch.Tensor:
        rows = _joined(self.features)
        self.features, self.num_features = [], 0
        return rows


class HeadRunner:
    reads_features = True
    row_offset = -1  # a token at position p is fed by row p - 1 (see the module docstring)

    def __init__(self, head, *, vocab_size: int, num_blocks: int, block_size: int, device: torch.device,
                 cuda_graphs: bool = False, max_seqs: int = 32, prefix_caching: bool = False) -> None:
        """``vocab_size``: the target's vocabulary (the head's distribution is scattered into it).
        ``cuda_graphs``: on CUDA, the drafting loop's steps (one row for each of up to
        ``max_seqs`` sequences) replay CUDA graphs (engine/step_graphs.py). ``prefix_caching``:
        rows computed from the target's features stay findable by the tokens they read (a row
        reads the token after its position), so a prompt whose start the target takes from its
        prefix cache finds the head's rows for it too."""
        self.head = head
        self.runner = ModelRunner(head, num_blocks=num_blocks, block_size=block_size, device=device)
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            self.graphs = self.runner.static_steps(max_seqs, 1, capture=True, forward=self.step_forward)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching, lookahead=1)
        self.vocab_size = vocab_size
        self.device = device
        self.draft_to_target: list[int] = head.draft_to_target.tolist()  # draft id -> target id

    # -- rows ---------------------------------------------------------------------------

    def catch_up(self, states: list[HeadState], contexts: list[list[int]]) -> None:
        """Run every state's waiting features (states must be ``ready``); afterwards ``clean`` is
        ``len(context) - 1`` and ``last_out`` (with its logits ``last_logits``) predicts the token
        after the context."""
        todo = [i for i, st in enumerate(states) if st.num_features]
        if not todo:
            return
        for i in todo:
            states[i].keep(states[i].clean)
            self.blocks.grow(states[i], len(contexts[i]) - 1)
        feeds = [contexts[i][states[i].clean + 1 :] for i in todo]
        starts = [states[i].clean for i in todo]
        features = _joined([states[i].take_features() for i in todo])
        rows = last_rows(feeds)
        # a prefill pass: the native path where its bound allows (a prompt's catch-up may not)
        out, logits = self._rows([states[i] for i in todo], starts, feeds, None, decode=False, features=features,
                                 logit_rows=rows)
        for j, (row, i) in enumerate(zip(rows, todo, strict=True)):
            st = states[i]
            st.clean = st.num_cached_tokens = len(contexts[i]) - 1
            st.last_out, st.last_logits = out[row : row + 1], logits[j : j + 1]
            self.blocks.register(st, contexts[i], st.clean)

    def cached_rows(self, context: list[int], num_tokens: int) -> int:
        """How many of the first ``num_tokens`` rows of a sequence with ``context`` its prefix
        cache holds (whole blocks)."""
        return len(self.blocks.cached_prefix(context, num_tokens)) * self.blocks.block_size

    def adopt(self, state: HeadState, context: list[int], num_tokens: int) -> None:
        """``state`` (new) starts from its first ``num_tokens`` rows cached (``cached_rows``):
        the target's features follow from there."""
        self.blocks.take_prefix(state, self.blocks.cached_prefix(context, num_tokens))
        if state.num_cached_tokens != num_tokens:
            raise RuntimeError(f"the head's cache holds {state.num_cached_tokens} rows, not the {num_tokens} taken")
        state.clean = num_tokens

    def decode_step(self, tables: list, positions: list[int], tokens: list[int], hidden: torch.Tensor):
        """One row per table: token ``tokens[i]`` at ``positions[i] + 1`` read by row
        ``positions[i]`` with ``hidden[i]``; (draft-vocabulary logits [n, draft vocab], the head's
        outputs [n, d]). ``sample`` draws from such logits."""
        out, logits = self._rows(tables, positions, [[t] for t in tokens], hidden, decode=True)
        return logits, out

    def _rows(self, tables: list, starts: list[int], feeds: list[list[int]], hidden: torch.Tensor | None, *,
              decode: bool, features: torch.Tensor | None = None, logit_rows: list[int] | None = None):
        """(the head's outputs of these rows, the draft logits of ``logit_rows``, all rows by
        default); the input is ``hidden``, or the target's ``features``."""
        ids, pos, meta = self.runner.prepare(tables, starts, feeds, decode=decode)
        if decode and self.graphs is not None and features is None and logit_rows is None:
            out = self.graphs.run(ids, pos, meta, True, hidden)
            if out is not None:
                return out
        rows = range(len(ids)) if logit_rows is None else logit_rows
        return self.head(ids, pos, hidden, self.runner.kv_caches, meta, features=features, logit_rows=rows)

    def step_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta, logits: bool, hidden: torch.Tensor):
        """A drafting step as the static steps run it: (outputs, draft logits) of every row."""
        return self.head(ids, pos, hidden, self.runner.kv_caches, meta, logit_rows=range(len(ids)))

    def in_target_vocabulary(self, q: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary distributions [n, draft vocab] -> the same over the target's
        vocabulary [n, V], zero at every target id the head cannot propose."""
        out = torch.zeros((len(q), self.vocab_size), dtype=q.dtype, device=self.device)
        out[:, self.head.draft_to_target] = q
        return out

    def sample(self, draft_logits: torch.Tensor, params: list[SamplingParams], generators: list,
               reshape: Reshape | None = None) -> Draw:
        """One token per row of the head's draft-vocabulary logits, through the one sampling
        module: the tokens as target ids, the q of the sampled rows still over the draft
        vocabulary (``in_target_vocabulary`` scatters them).

        Filtering, reshaping and drawing over the draft vocabulary (4096 ids where the target has
        49152; a step's sampling cost several head forwards over the whole vocabulary) give the
        same q as over the scattered logits (-inf elsewhere): tokens of probability 0 add nothing
        to a filter, and Saguaro's reshape scales a row's most probable tokens and renormalises.
        The draft ids being in target-id order, the draws are the same too."""
        return self._as_target(sample(draft_logits, params, generators, reshape))

    # -- the drafting loop --------------------------------------------------------------

    def draft(
        self,
        states: list[HeadState],
        contexts: list[list[int]],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        reshape: Reshape | None = None,
        min_confidence: float = 0.0,
    ) -> list[Drafted]:
        """Draft up to ``num_tokens[i]`` tokens after ``contexts[i]``: catch up on the target's
        features, then one row per token on the head's own output. A chain takes its next token
        only while the head's probability of the chain so far times its top probability there
        stays at or above ``min_confidence``, so a chain may be empty (the round is then a plain
        decode step). The decision at a position depends on the tokens before it and the head's
        distribution there, never on the token drawn there, so verification stays exact. A
        state that is not ``ready``, or for whose rows the head's cache has no room this round,
        gets no tokens. (Its cache is as large as the target's and held no more before prefix
        caching; a prefix now taken from it can cost blocks that the target's shared copy did not.)"""
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        active, spare = [], self.blocks.num_free_blocks
        for i, n in enumerate(num_tokens):
            if n > 0 and states[i].ready(len(contexts[i])):
                need = max(0, self.blocks.blocks_for(len(contexts[i]) - 2 + n) - len(states[i].block_table))
                if need <= spare:
                    spare -= need
                    active.append(i)
        if active:
            for i in active:
                self.blocks.grow(states[i], len(contexts[i]) - 2 + num_tokens[i])
            self.catch_up([states[i] for i in active], [contexts[i] for i in active])
            out = _joined([states[i].last_out for i in active])
            logits = _joined([states[i].last_logits for i in active])
        confidence = [1.0] * len(states)
        step = 0
        while active:
            draw, p, top = self._draw(logits, [params[i] for i in active], [generators[i] for i in active],
                                      reshape, with_confidence=min_confidence > 0)
            keep = []
            for row, i in enumerate(active):
                if confidence[i] * top[row] < min_confidence:
                    continue  # the chain ends before this position (its draw is discarded)
                tokens[i].append(draw.tokens[row])
                q = draw.q_of(row)
                if q is not None:
                    probs[i].append(q)
                confidence[i] *= p[row]
                if len(tokens[i]) < num_tokens[i]:
                    keep.append(row)
            active = [active[r] for r in keep]
            if not active:
                break
            if len(keep) < len(out):
                out = out.index_select(0, torch.tensor(keep, device=self.device))
            positions = [len(contexts[i]) - 1 + step for i in active]
            step += 1
            out, logits = self._rows([states[i] for i in active], positions, [[tokens[i][-1]] for i in active], out,
                                     decode=True)
        return [Drafted(t, self.in_target_vocabulary(torch.stack(p)) if p else None)
                for t, p in zip(tokens, probs, strict=True)]

    def _draw(self, draft_logits: torch.Tensor, params: list[SamplingParams], generators: list,
              reshape: Reshape | None, *, with_confidence: bool) -> tuple[Draw, list[float], list[float]]:
        """``sample``'s draw, the head's probability of each row's token and its top probability in
        each row (ones for both unless ``with_confidence``)."""
        draw = sample(draft_logits, params, generators, reshape)  # draft ids
        if not with_confidence:
            confidence = top = [1.0] * len(params)
        else:
            head_probs = torch.softmax(draft_logits, dim=-1)
            chosen = torch.tensor(draw.tokens, device=self.device).unsqueeze(1)
            confidence = head_probs.gather(1, chosen).squeeze(1).tolist()
            top = head_probs.amax(dim=-1).tolist()
        return self._as_target(draw), confidence, top

    def _as_target(self, draw: Draw) -> Draw:
        return Draw([self.draft_to_target[t] for t in draw.tokens], draw.sampled, draw.probs)

    # -- SSD's glue ---------------------------------------------------------------------

    def glue(self, states: list[HeadState], contexts: list[list[int]], specs: list[list[int]]):
        """For each (ready) state, the head's distributions L_0..L_m after ``context``, ``context +
        spec[:1]``, .., ``context + spec`` (m = len(spec)): (draft-vocabulary logits [m + 1, draft
        vocab] per state, the head's outputs behind them [m + 1, d] per state). The spec's rows are
        written as the head's own chain would write them (stand-ins until the target's features
        exist)."""
        self.catch_up(states, contexts)
        outs = [[st.last_out] for st in states]
        logits = [[st.last_logits] for st in states]
        for st, context, spec in zip(states, contexts, specs, strict=True):
            st.keep(st.clean)
            self.blocks.grow(st, len(context) - 1 + len(spec))
        for j in range(max((len(s) for s in specs), default=0)):
            active = [i for i, s in enumerate(specs) if len(s) > j]
            hidden = _joined([outs[i][-1] for i in active])
            out, step_logits = self._rows([states[i] for i in active], [len(contexts[i]) - 1 + j for i in active],
                                          [[specs[i][j]] for i in active], hidden, decode=True)
            for row, i in enumerate(active):
                outs[i].append(out[row : row + 1])
                logits[i].append(step_logits[row : row + 1])
        for st, context, spec in zip(states, contexts, specs, strict=True):
            st.num_cached_tokens = len(context) - 1 + len(spec)
        return [torch.cat(lg) for lg in logits], [torch.cat(o) for o in outs]

    def release(self, state: DraftState) -> None:
        self.blocks.free(state)

    def draft_step_seconds(self) -> float:
        """Median time of one head step (one row after a 64-row context, or as long a context as
        the head's positions and its free cache allow, with its logits)."""
        from specfork.speculative.auto_k import MEASURE_CONTEXT, measurable_context, time_call

        st = HeadState()
        context = max(1, min(MEASURE_CONTEXT, self.head.rotary.cos.size(0) - 1, measurable_context(self.blocks, 1)))
        self.blocks.grow(st, context + 1)
        d = self.head.config.hidden_size
        try:
            self._rows([st], [0], [[1] * context], torch.zeros(context, d, device=self.device), decode=False,
                       logit_rows=[])
            return time_call(lambda: self._rows([st], [context], [[1]], torch.zeros(1, d, device=self.device),
                                                decode=True))
        finally:
            self.blocks.free(st)


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)``, without the copy for one tensor (a round's usual case)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
