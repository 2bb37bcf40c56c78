"""The one drafting loop: a draft model with its own paged KV cache drafts up to k tokens per
sequence, k batched forwards, each token drawn through the one sampling module with the
request's own settings. The SD proposer and the SSD drafter's just-in-time backup both use it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfork.engine.block_manager import BlockManager
from specfork.engine.model_runner import ModelRunner
from specfork.sampling import Draw, Reshape, sample
from specfork.sampling_params import SamplingParams


@dataclass
class DraftState:
    """One sequence in the draft's KV cache: its blocks, and how many leading tokens of its
    context (committed tokens, then its latest drafts) have valid keys/values there."""

    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its leading full blocks

    def keep(self, num_tokens: int) -> None:
        """Only the first ``num_tokens`` tokens of the context are still valid (the rest were
        rejected or never written)."""
        self.num_cached_tokens = min(self.num_cached_tokens, num_tokens)


@dataclass(slots=True)
class Drafted:
    """What one sequence got: its tokens and, when it samples, the distributions q they were
    drawn from ([len(tokens), V]; None for greedy requests or no tokens)."""

    tokens: list[int]
    probs: torch.Tensor | None


class DraftRunner:
    reads_features = False
    row_offset = 0  # a token at position p is fed at position p
    draft_to_target: list[int] | None = None  # a logit column's target id (None: the column is the id)

    def __init__(self, model, *, vocab_size: int, num_blocks: int, block_size: int, device: torch.device,
                 cuda_graphs: bool = False, max_seqs: int = 32, max_rows: int = 9) -> None:
        """``vocab_size``: the target's vocabulary (draft rows beyond it are never proposed).
        ``cuda_graphs``: on CUDA, decode steps of up to ``max_seqs`` sequences x ``max_rows``
        rows replay CUDA graphs (engine/step_graphs.py)."""
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, device=device,
                                  cuda_graphs=cuda_graphs, max_seqs=max_seqs, max_rows=max_rows)
        self.blocks = BlockManager(num_blocks, block_size)
        self.vocab_size = vocab_size
        self.device = device

    def draft(
        self,
        states: list[DraftState],
        contexts: list[list[int]],
        num_tokens: list[int],
        params: list[SamplingParams],
        generators: list[torch.Generator],
        reshape: Reshape | None = None,
    ) -> list[Drafted]:
        """Draft ``num_tokens[i]`` tokens after ``contexts[i]`` (whose first
        ``states[i].num_cached_tokens`` tokens are already in the cache). Afterwards the cache
        holds the context and every drafted token but the last."""
        tokens: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        active = [i for i, n in enumerate(num_tokens) if n > 0]
        for i in active:
            self.blocks.grow(states[i], len(contexts[i]) + num_tokens[i] - 1)
        while active:
            feeds = [_uncached(states[i], contexts[i], tokens[i]) for i in active]
            # A feed longer than a round (a prompt, or a context to catch up) is a prefill pass.
            decode = max(len(f) for f in feeds) <= max(num_tokens) + 1
            logits = self.runner.forward(
                [states[i] for i in active], [states[i].num_cached_tokens for i in active], feeds,
                last_rows(feeds), decode=decode,
            )[:, : self.vocab_size]
            for i, f in zip(active, feeds, strict=True):
                states[i].num_cached_tokens += len(f)
            draw = sample(logits, [params[i] for i in active], [generators[i] for i in active], reshape)
            for row, i in enumerate(active):
                tokens[i].append(draw.tokens[row])
                q = draw.q_of(row)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(tokens[i]) < num_tokens[i]]
        return [Drafted(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs, strict=True)]

    def glue(self, states: list[DraftState], contexts: list[list[int]], specs: list[list[int]]):
        """SSD's glue: for each state, the draft's distributions L_0..L_m after ``context``,
        ``context + spec[:1]``, .., ``context + spec`` (m = len(spec)) from one causal forward that
        writes the context's last token and the spec into the cache: (logits [m + 1, V] per
        state, None: the model carries no hidden from row to row)."""
        feeds, starts, counts, rows = [], [], [], []
        offset = 0
        for st, context, spec in zip(states, contexts, specs, strict=True):
            st.keep(len(context) - 1)  # the last token onwards is recomputed: its logits are L_0
            known = context + spec
            self.blocks.grow(st, len(known))
            feeds.append(known[st.num_cached_tokens :])
            starts.append(st.num_cached_tokens)
            counts.append(len(spec) + 1)
            offset += len(feeds[-1])
            rows.extend(range(offset - counts[-1], offset))
        logits = self.runner.forward(states, starts, feeds, rows, decode=False)[:, : self.vocab_size]
        for st, f in zip(states, feeds, strict=True):
            st.num_cached_tokens += len(f)
        return list(logits.split(counts)), None

    def decode_step(self, tables: list, positions: list[int], tokens: list[int], hidden=None):
        """One token per table, ``tokens[i]`` at ``positions[i]``: (logits [n, V], None)."""
        logits = self.runner.forward(tables, positions, [[t] for t in tokens], list(range(len(tokens))), decode=True)
        return logits[:, : self.vocab_size], None

    @staticmethod
    def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list,
               reshape: Reshape | None = None) -> Draw:
        """One token per row of this runner's logits (a draft model's columns are target ids)."""
        return sample(logits, params, generators, reshape)

    @staticmethod
    def in_target_vocabulary(q: torch.Tensor) -> torch.Tensor:
        """A draft model's q is over the target's vocabulary already."""
        return q

    def release(self, state: DraftState) -> None:
        self.blocks.free(state)


def _uncached(state: DraftState, context: list[int], drafted: list[int]) -> list[int]:
    """The tokens of ``context + drafted`` from the first one not in the cache."""
    start = state.num_cached_tokens
    if start >= len(context):
        return drafted[start - len(context) :]
    return context[start:] + drafted


def last_rows(feeds: list[list[int]]) -> list[int]:
    """The flat row of each feed's last token."""
    rows, offset = [], 0
    for f in feeds:
        offset += len(f)
        rows.append(offset - 1)
    return rows
