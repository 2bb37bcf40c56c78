"""Token sampling, the one module every decoding mode draws through.

``adjust_logits_`` applies a request's structured output (its grammar's mask), allowed ids,
bad words, ``min_tokens``, logit bias, penalties and ``min_p`` to the target's logits (each row
after the very tokens it follows, drafts included in a verify window), before AR sampling and
speculative verification alike. Drafters draw without
them: verification needs only the distribution each draft was drawn from, and adjusting the
EAGLE-3 head's own logits the same way bought no acceptance (docs/decisions.md).

``logits_to_probs`` is the one filter (temperature, then top-k, then top-p), so autoregressive
sampling, draft proposals and speculative verification all see the very same distribution for a
request; on the CPU its native form (``csrc/sampling.cpp``, tested to keep the same tokens) runs in
its place wherever the kernels are built, for every row alike. ``sample`` draws one token per row:
argmax for greedy requests, otherwise a draw from the filtered distribution with the request's own
generator (one uniform per draw); a ``reshape`` hook may replace the filtered distribution before
the draw (SSD's Saguaro sampling), and the distribution actually drawn from is what is returned, so
verification stays exact.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from specfork.sampling_params import SamplingParams

if TYPE_CHECKING:
    from specfork.structured_output import OutputGrammar

Reshape = Callable[[torch.Tensor], torch.Tensor]  # [N, V] probabilities -> [N, V] probabilities


@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What a request's logit adjustments read: its settings, the tokens its next logits follow
    (the prompt's ``num_prompt_tokens``, then the output), and the tokens ``min_tokens`` holds back
    (EOS unless ignored, and the stop token ids), and the bad words' tokens. ``drafts`` make it a
    verify window: its row j
    follows ``token_ids + drafts[:j]``. (Built every step for every request: it copies nothing.)"""

    params: SamplingParams
    token_ids: Sequence[int]
    num_prompt_tokens: int
    stop_ids: frozenset[int]
    drafts: Sequence[int] = ()
    bad_words: Sequence[Sequence[int]] = ()  # token sequences never to complete
    grammar: OutputGrammar | None = None  # the output's matcher (structured outputs)

    @property
    def rows(self) -> int:
        return len(self.drafts) + 1

    @property
    def adjusts_in_python(self) -> bool:
        """Whether an adjustment here needs Python at every step: a grammar, allowed ids or bad
        words (several decode steps in one native call take the others along: ``step_adjustments``)."""
        return self.grammar is not None or bool(self.bad_words) or bool(self.params.allowed_token_ids)

    @property
    def adjusts(self) -> bool:
        """Whether ``adjust_logits_`` changes these rows: min_tokens only while it holds something
        back (a request past it, or with nothing to hold back, costs nothing)."""
        params = self.params
        holds_back = params.min_tokens > len(self.token_ids) - self.num_prompt_tokens and bool(self.stop_ids)
        return holds_back or params.adjusts_logits or bool(self.bad_words) or self.grammar is not None


def adjust_logits_(logits: torch.Tensor, histories: Sequence[TokenHistory]) -> dict[int, torch.Tensor]:
    """Each request's adjustments applied to its rows of ``logits`` [N, V], in place, in vLLM's
    order: the structured output's grammar (every token that cannot continue the output at -inf),
    ``allowed_token_ids`` (every other token at -inf), bad words (the last token of each
    at -inf where the tokens before it end the row's output), ``min_tokens`` (its held-back
    tokens at -inf while the output is shorter), ``logit_bias`` added, ``repetition_penalty`` (the
    logits of tokens in the prompt or output divided by it where positive, multiplied where not),
    ``frequency_penalty`` x each token's count in the output and ``presence_penalty`` for each token
    present subtracted, then ``min_p`` for sampled rows (-inf for every token whose probability at
    the request's temperature is below min_p x the largest: a logit more than temperature x
    -log(min_p) under the largest).

    ``histories[i]`` covers ``histories[i].rows`` consecutive rows. Every row is adjusted by the
    same element-wise operations whatever shares its call, so AR and verification see the same
    numbers. Only the windows that adjust are touched and nothing else is copied, so a batch pays
    for its adjusting requests' rows alone (none: one pass over the histories). Returns, for each
    window that changed and whose request asked for log-probabilities, a copy of its rows from
    before (log-probabilities are of the model's own logits)."""
    if sum(h.rows for h in histories) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for histories of {sum(h.rows for h in histories)} rows")
    raw = {}
    first = 0
    with torch.inference_mode():  # the logits of a forward are inference tensors: written in place here only
        for i, history in enumerate(histories):
            if history.adjusts:
                window = logits[first : first + history.rows]
                if history.params.logprobs is not None:
                    raw[i] = window.clone()
                _adjust_window(window, history)
            first += history.rows
    return raw


def _adjust_window(rows: torch.Tensor, history: TokenHistory) -> None:
    """``adjust_logits_`` for one request's consecutive rows, all rows at once (its penalties,
    bias, min_p and min_tokens are repeated operation for operation in
    ``csrc/logit_adjustments.cpp`` for decode steps in one call: change both together;
    ``tests/test_logit_adjustments.py`` compares them bit for bit): a
    penalty touches only the columns of the tokens it applies to, each from the first row whose
    history holds the token. In NumPy (the rows copied over and back off the CPU): PyTorch's
    comparisons into a bool mask took ~60 us a row of 49152 on one core, NumPy's a tenth of it."""
    params, (n, vocab) = history.params, rows.shape
    on_cpu = rows.device.type == "cpu" and rows.dtype == torch.float32
    a = rows.numpy() if on_cpu else rows.float().cpu().numpy()
    num_output = len(history.token_ids) - history.num_prompt_tokens
    drafts = list(history.drafts[: n - 1])
    if history.grammar is not None:
        history.grammar.mask_(a, history.token_ids[history.num_prompt_tokens :], drafts)
    if params.allowed_token_ids:
        _keep_only(a, np.unique(np.fromiter(params.allowed_token_ids, dtype=np.int64)))
    if history.bad_words:  # matched against the output only, as vLLM does (never the prompt)
        before = max(len(w) for w in history.bad_words) - 1  # the context a word's first tokens need
        tail = list(history.token_ids[max(history.num_prompt_tokens, len(history.token_ids) - before) :])
        for j in range(n):
            context = tail + drafts[:j]
            banned = [w[-1] for w in history.bad_words if w[-1] < vocab and (
                len(w) == 1 or (len(context) >= len(w) - 1 and context[-(len(w) - 1) :] == list(w[:-1])))]
            a[j, banned] = -np.inf
    held_back = [t for t in history.stop_ids if t < vocab]
    short = min(n, params.min_tokens - num_output)  # rows whose output is still under min_tokens
    if short > 0 and held_back:
        a[:short, held_back] = -np.inf
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64, count=len(params.logit_bias))
        a[:, ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32, count=len(params.logit_bias))
    if params.repetition_penalty != 1.0:
        first_row = dict.fromkeys(history.token_ids, 0)  # a token's first row: 0, or 1 + its first draft
        for i, token in enumerate(drafts):
            first_row.setdefault(token, i + 1)
        ids = np.fromiter(first_row, dtype=np.int64, count=len(first_row))
        applies = np.arange(n)[:, None] >= np.fromiter(first_row.values(), dtype=np.int64, count=len(first_row))
        values, penalty = a[:, ids], np.float32(params.repetition_penalty)
        a[:, ids] = np.where(applies, np.where(values > 0, values / penalty, values * penalty), values)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        counts = Counter(history.token_ids[history.num_prompt_tokens :])
        column = {token: c for c, token in enumerate([*counts, *(t for t in dict.fromkeys(drafts) if t not in counts)])}
        times = np.zeros((n, len(column)), dtype=np.float32)  # each token's count in each row's output
        times[:, : len(counts)] = np.fromiter(counts.values(), dtype=np.float32, count=len(counts))
        for i, token in enumerate(drafts):
            times[i + 1 :, column[token]] += 1
        ids = np.fromiter(column, dtype=np.int64, count=len(column))
        present = (times > 0).astype(np.float32)
        a[:, ids] = (a[:, ids] - np.float32(params.frequency_penalty) * times
                     - np.float32(params.presence_penalty) * present)
    if params.min_p > 0.0 and not params.greedy:
        # p < min_p * p_max at temperature T  <=>  logit < largest + T * log(min_p)
        floor = a.max(axis=1) + np.float32(params.temperature * math.log(params.min_p))
        for row, lowest in zip(a, floor, strict=True):
            _keep_only(row, np.flatnonzero(row >= lowest))
    if not on_cpu:
        rows.copy_(torch.from_numpy(a))


def _keep_only(a: np.ndarray, columns: np.ndarray) -> None:
    """Every column of ``a`` (a row, or rows) but ``columns`` set to -inf: the few kept values are
    read out, the whole array filled, and they are put back (a store through a mask took 5x as
    long)."""
    kept = a[..., columns]
    a.fill(-np.inf)
    a[..., columns] = kept


def sampling_tensors(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row temperature, top-k and top-p (greedy rows get temperature 1; callers argmax them)."""
    temp = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32, device=device)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    return temp, top_k, top_p


def logits_to_probs(
    logits: torch.Tensor,  # [N, V] float32
    temperature: torch.Tensor,  # [N] float32, > 0
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float32, 1.0 = off
) -> torch.Tensor:
    """Probabilities [N, V] after temperature scaling, then top-k, then top-p (nucleus).

    Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept).
    Top-p keeps the smallest prefix of tokens, by descending probability, whose mass reaches
    ``top_p`` (at least one token; ties at the boundary are kept).

    Neither sorts the vocabulary: the k-th largest logit comes from ``topk``, and the nucleus is
    searched among each row's largest NUCLEUS_WIDTH probabilities, widened (4x at a time) only
    for a row whose nucleus is wider. (Sorting 49152 logits took ~4 ms a row on a 2-core CPU, about a
    decode step of the embedded model.)
    """
    scaled = logits / temperature.unsqueeze(1)
    vocab = scaled.shape[-1]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k:
        on = top_k > 0
        k = top_k.clamp(min=1, max=vocab)
        kth = scaled.topk(int(k[on].max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth.masked_fill(~on.unsqueeze(1), float("-inf")), float("-inf"))
    if need_p:
        scaled = scaled.masked_fill(_outside_nucleus(scaled.softmax(dim=-1), top_p), float("-inf"))
    return scaled.softmax(dim=-1)


NUCLEUS_WIDTH = 64  # candidates searched first for a row's nucleus (4x more while too few)


def _outside_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: the tokens top-p removes from each row of ``probs`` (none where top_p is 1).
    By descending probability, a token is kept while the mass before it is below top_p (the first
    always); every token as probable as the last one kept is kept too, so the kept set does not
    depend on the order of tied tokens (nor on how many candidates were searched).

    The candidates are each row's largest NUCLEUS_WIDTH probabilities; only the rows whose
    nucleus is wider search again, among 4x as many (a flat draft distribution's nucleus can
    hold thousands of tokens, and ``topk`` of the whole batch at every width cost more than the
    draft's forward)."""
    n, vocab = probs.shape
    last_kept = torch.zeros(n, 1, dtype=probs.dtype, device=probs.device)  # 0 keeps every token
    todo = torch.nonzero(top_p < 1.0).squeeze(1)
    width = min(NUCLEUS_WIDTH, vocab)
    while len(todo):
        p = top_p.index_select(0, todo).unsqueeze(1)
        values, _ = probs.index_select(0, todo).topk(width, dim=-1)  # descending
        mass = values.cumsum(dim=-1)
        done = (mass[:, -1:] >= p).squeeze(1) | (width == vocab)  # the nucleus ends within the candidates
        # mass before a token only grows along the row, so the kept tokens are a prefix
        kept = ((mass - values) < p).sum(dim=-1, keepdim=True).clamp_(min=1)
        last_kept[todo[done]] = values.gather(1, kept - 1)[done]
        todo = todo[~done]
        width = min(4 * width, vocab)
    return probs < last_kept


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits_to_probs`` with row i filtered by ``params[i]``. CPU float32 rows go through the
    native kernel when it is built (``csrc/sampling.cpp``'s filtered_prob_rows: the same filter,
    top-k's k-th largest found among candidates above a rising threshold and top-p's nucleus
    searched in the one band of probability where it ends, where this module's PyTorch form runs a
    dozen ops and ``topk`` over the whole row: on the embedded model's logits with top-p, 0.55-0.77
    ms a row on a 2-core Xeon, against 0.16-0.18 ms for the kernel's filter and draw together).
    Top-k keeps the same tokens bit for bit. Top-p sums in float64 where the PyTorch form's running
    mass is float32, with an exponential within 2 ulp of PyTorch's, so a nucleus whose mass comes
    within rounding of top-p can end a token or a few apart (seen only for nuclei of thousands)."""
    tensors = sampling_tensors(params, logits.device)
    kernels = native_sampler(logits)
    return logits_to_probs(logits, *tensors) if kernels is None else kernels.filtered_prob_rows(logits.contiguous(), *tensors)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` [N, V] (the first one on ties, a NaN counting as the
    largest value, as ``torch.argmax`` does). On the CPU it goes through NumPy, whose argmax is
    vectorised: ~4 us for a 49152-token row where torch's takes ~30 us, paid on every greedy
    step and every verified row."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return np.argmax(logits.numpy(), axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


DRAW_BLOCK = 256  # tokens per block of the two-level inverse transform


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of ``probs`` [N, V] (weights: a row need not sum to 1), row i drawn with
    ``generators[i]`` by inverse transform sampling: the first token whose cumulative weight
    exceeds a uniform draw times the row's total, in float64, first among blocks of DRAW_BLOCK
    tokens, then within the block. A token of weight 0 is never drawn.

    One uniform a row. (An exponential race, argmax p / E, drew 49152 exponentials a row: ~1 ms on
    a 2-core CPU, a fifth of a decode step. A float64 cumulative sum over the whole row took 2 ms
    for 8 rows, mostly writing the 3 MB it needs; the blocks take 0.36 ms.)

    CPU float32 rows go through the native kernel when it is built (``csrc/sampling.cpp``: the same
    blocks, sums and search in one pass per row, where this function's PyTorch form, ``_draw_blocks``,
    runs a dozen small ops)."""
    uniforms = draw_uniforms(generators, probs.device)
    kernels = native_sampler(probs)
    return _draw_blocks(probs, uniforms) if kernels is None else kernels.sample_weight_rows(probs.contiguous(), uniforms)


def _draw_blocks(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``sample_from_probs`` in PyTorch ops, with one uniform per row given."""
    n, vocab = probs.shape
    pad = (-vocab) % DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).reshape(n, -1, DRAW_BLOCK)
    by_block = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [N, blocks]
    total = by_block[:, -1:]
    point = uniforms.unsqueeze(1) * total
    block = _first_above(by_block, point)
    before = torch.where(block > 0, by_block.gather(1, (block - 1).clamp(min=0)), torch.zeros_like(point))
    within = blocks[torch.arange(n, device=probs.device), block.squeeze(1)].to(torch.float64).cumsum(dim=-1)
    return (block * DRAW_BLOCK + _first_above(within, point - before)).squeeze(1)


def draw_uniforms(generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """[N] float64: one uniform draw from each row's generator."""
    return torch.cat([torch.rand(1, dtype=torch.float64, generator=gen, device=device) for gen in generators])


def _first_above(cumulative: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    """[N, 1]: per row, the first index whose cumulative weight exceeds ``point`` [N, 1], or the
    last index of positive weight where rounding put ``point`` at or past the row's total."""
    last = (cumulative < cumulative[:, -1:]).sum(dim=-1, keepdim=True)
    return torch.minimum(torch.searchsorted(cumulative, point, right=True), last)


@dataclass(slots=True)
class Draw:
    """One token per row; ``probs[j]`` is the distribution row ``sampled[j]`` was drawn from
    (None when every row is greedy)."""

    tokens: list[int]
    sampled: list[int]
    probs: torch.Tensor | None
    _where: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._where = {row: j for j, row in enumerate(self.sampled)}

    def q_of(self, row: int) -> torch.Tensor | None:
        """The distribution ``row`` was drawn from, or None for a greedy row."""
        j = self._where.get(row)
        return None if j is None else self.probs[j]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    reshape: Reshape | None = None,
) -> Draw:
    """One token per row of ``logits`` [N, V]: argmax where ``params[i]`` is greedy, else a draw
    with ``generators[i]`` from the filtered distribution (passed through ``reshape`` first)."""
    tokens = greedy_tokens(logits)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return Draw(tokens, sampled, None)
    idx = torch.tensor(sampled, device=logits.device)
    probs = filtered_probs(logits.index_select(0, idx), [params[i] for i in sampled])
    if reshape is not None:
        probs = reshape(probs)
    for i, token in zip(sampled, sample_from_probs(probs, [generators[i] for i in sampled]).tolist(), strict=True):
        tokens[i] = token
    return Draw(tokens, sampled, probs)


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator]) -> list[int]:
    """``sample(logits, params, generators).tokens``, for callers that want only the tokens (AR and
    SD's plain passes). On the CPU the sampled rows are drawn by the native kernel when it is built:
    each row filtered (temperature, top-k, top-p) and drawn by the same two-level inverse transform
    as ``sample_from_probs``, with the same uniform from the row's generator, in a few passes per
    row instead of a tensor per stage. Its exponential is within 2 ulp of ``std::exp`` (PyTorch's is
    another within a few ulp), so a draw within rounding of a boundary between two tokens can fall
    the other way; the distribution is the same. (After a forward has evicted the caches, 8 rows
    took 3.06 ms on the PyTorch path's dozen small ops and 0.50 ms here, 1 row 0.93 -> 0.27 ms.)

    Which path a row takes depends on the device alone, so a row draws alike alone and in any batch."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    kernels = native_sampler(logits) if sampled else None
    if kernels is None:
        return sample(logits, params, generators).tokens
    tokens = greedy_tokens(logits) if len(sampled) < len(params) else [0] * len(params)
    selected = logits if len(sampled) == len(params) else logits.index_select(0, torch.tensor(sampled))
    drawn = kernels.sample_logit_rows(selected.contiguous(), *sampling_tensors([params[i] for i in sampled], logits.device),
                                      draw_uniforms([generators[i] for i in sampled], logits.device))
    for i, token in zip(sampled, drawn.tolist(), strict=True):
        tokens[i] = token
    return tokens


@dataclass(frozen=True, slots=True)
class StepDraws:
    """What several decode steps in one native call need to choose each row's token at every step
    as ``adjust_logits_`` and ``sample_tokens`` would one step at a time (the kernels'
    ``LogitAdjustments`` and ``sample_logit_rows``): per row [B] its temperature (0: a greedy row,
    its argmax), top-k and top-p, per step and row [steps, B] the uniform of its draw, and the rows'
    logit adjustments packed by ``step_adjustments`` (empty: none)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    uniforms: torch.Tensor  # float64
    adjustments: tuple[torch.Tensor, ...] = ()


def step_draws(params: Sequence[SamplingParams], generators: Sequence[torch.Generator], steps: int,
               device: torch.device, histories: Sequence[TokenHistory] = ()) -> StepDraws:
    """The draws of ``steps`` decode steps for rows with ``params`` and ``generators``: a sampled
    row takes one uniform a step from its generator, in the order that many steps of
    ``sample_tokens`` take them; a greedy row takes none (its uniforms are 0, unused). With the
    rows' ``histories`` (none adjusting ``adjusts_in_python``), their adjustments go along."""
    temp, top_k, top_p = sampling_tensors(params, device)
    greedy = torch.tensor([p.greedy for p in params], device=device)
    uniforms = torch.zeros(steps, len(params), dtype=torch.float64, device=device)
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            uniforms[:, i] = torch.cat([draw_uniforms([gen], device) for _ in range(steps)])
    adjustments = step_adjustments(histories) if any(h.adjusts for h in histories) else ()
    return StepDraws(temp.masked_fill(greedy, 0.0), top_k, top_p, uniforms, adjustments)


def step_adjustments(histories: Sequence[TokenHistory]) -> tuple[torch.Tensor, ...]:
    """One row per history (none adjusting ``adjusts_in_python``), the adjustments of
    ``adjust_logits_`` packed for the kernels' ``LogitAdjustments`` (``csrc/kernels.h``), which
    apply them at each decode step as ``adjust_logits_`` would, each row's history growing by its
    tokens: (settings [B, 4] float32: repetition penalty, frequency and presence penalties, min_p's
    offset from the largest logit or NaN; the steps min_tokens still holds back [B]; ids, values,
    offsets [B, 5]: per row its logit-bias ids (values: the biases), held-back ids, the ids of its
    prompt and output, and its output ids (values: their counts))."""
    settings = np.zeros((len(histories), 4), dtype=np.float32)
    settings[:, 0], settings[:, 3] = 1.0, np.nan
    held = np.zeros(len(histories), dtype=np.int64)
    offsets = np.zeros((len(histories), 5), dtype=np.int64)
    ids: list[int] = []
    values: list[float] = []
    for b, history in enumerate(histories):
        if history.adjusts_in_python:
            raise ValueError("a grammar, allowed ids or bad words adjust logits one step a call")
        params = history.params
        lists: list[tuple[list[int], list[float] | None]] = [([], None)] * 4  # offsets' four lists, in order
        if history.adjusts:
            lists[0] = [t for t, _ in params.logit_bias], [bias for _, bias in params.logit_bias]
            held[b] = max(0, params.min_tokens - (len(history.token_ids) - history.num_prompt_tokens))
            if held[b]:  # the kernel skips an id past the vocabulary, as adjust_logits_ does
                lists[1] = sorted(history.stop_ids), None
            if params.repetition_penalty != 1.0:
                settings[b, 0] = params.repetition_penalty
                lists[2] = list(dict.fromkeys(history.token_ids)), None
            if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
                # a penalty of 0 (or -0) as +0: a -0 in float32 means a tiny negative one, still on
                settings[b, 1:3] = [p if p != 0.0 else 0.0 for p in (params.frequency_penalty, params.presence_penalty)]
                counts = Counter(history.token_ids[history.num_prompt_tokens :])
                lists[3] = list(counts), [float(c) for c in counts.values()]
            if params.min_p > 0.0 and not params.greedy:
                settings[b, 3] = np.float32(params.temperature * math.log(params.min_p))
        for j, (list_ids, list_values) in enumerate(lists):
            offsets[b, j] = len(ids)
            ids.extend(list_ids)
            values.extend([0.0] * len(list_ids) if list_values is None else list_values)
        offsets[b, 4] = len(ids)
    return (torch.from_numpy(settings), torch.from_numpy(held), torch.tensor(ids, dtype=torch.int64),
            torch.tensor(values, dtype=torch.float32), torch.from_numpy(offsets))


def native_sampler(rows: torch.Tensor):
    """The compiled kernels for float32 rows on the CPU (None otherwise, or without them: the
    PyTorch path)."""
    if rows.device.type != "cpu" or rows.dtype != torch.float32:
        return None
    from specfork.native_kernels import kernels

    return kernels()
