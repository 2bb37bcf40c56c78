"""The sampling filter and sampler against exact, enumerated probabilities."""

import math

import pytest
import torch

from specfork import SamplingParams, SpecforkError
from specfork.native_kernels import kernels as native_kernels
from specfork.sampling import (
    DRAW_BLOCK,
    _draw_blocks,
    _first_above,
    draw_uniforms,
    greedy_tokens,
    logits_to_probs,
    sample_from_probs,
    sample_tokens,
    step_draws,
)

needs_kernel = pytest.mark.skipif(native_kernels() is None, reason="native kernels need a C++ compiler")


def _native_filter(logits, temperature, top_k, top_p):
    return native_kernels().filtered_prob_rows(logits.float().contiguous(), temperature.float().contiguous(),
                                               top_k.long().contiguous(), top_p.float().contiguous())


# The filter's two forms: PyTorch's (every device) and the native kernel's (CPU float32 rows, when built).
FILTERS = [pytest.param(logits_to_probs, id="pytorch"), pytest.param(_native_filter, id="native", marks=needs_kernel)]
each_filter = pytest.mark.parametrize("filter_rows", FILTERS)


def _probs(logits, temperature=1.0, top_k=0, top_p=1.0, filter_rows=logits_to_probs):
    return filter_rows(
        logits.unsqueeze(0),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
    )[0]


LOGITS = torch.tensor([2.0, 1.0, 0.5, 3.0, -1.0, 0.0, 1.5, -2.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_tokens_is_torch_argmax_on_ties_nan_and_inf(dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 49152, generator=g).to(dtype)
    logits[1, [7, 9000, 30000]] = 50.0  # a tie: the first index wins
    logits[2, 123] = float("nan")  # a NaN counts as the largest value
    logits[3, [5, 77]] = float("nan")
    logits[4] = float("-inf")
    logits[4, 999] = -1e30
    logits[5] = float("-inf")  # all equal: index 0
    logits[6, 48000] = float("inf")
    logits[7] = logits[7].round()  # many ties
    expected = logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits) == expected
    assert greedy_tokens(logits[:, :4096]) == logits[:, :4096].argmax(dim=-1).tolist()  # a strided view
    assert greedy_tokens(logits[2:3]) == [123]
    assert expected[1] == 7


@each_filter
def test_temperature_scales_logits(filter_rows):
    expected = torch.softmax(LOGITS / 0.7, dim=0)
    torch.testing.assert_close(_probs(LOGITS, temperature=0.7, filter_rows=filter_rows), expected)


@each_filter
def test_top_k_keeps_k_largest_renormalized(filter_rows):
    p = _probs(LOGITS, top_k=3, filter_rows=filter_rows)
    keep = [3, 0, 6]  # logits 3.0, 2.0, 1.5
    expected = torch.zeros(8)
    expected[keep] = torch.softmax(LOGITS[keep], dim=0)
    torch.testing.assert_close(p, expected)


@each_filter
def test_top_p_keeps_smallest_prefix_reaching_mass(filter_rows):
    full = torch.softmax(LOGITS, dim=0)
    order = full.argsort(descending=True).tolist()
    for top_p in (0.3, 0.5, 0.8, 0.95):
        keep, mass = [], 0.0
        for i in order:
            keep.append(i)
            mass += full[i].item()
            if mass >= top_p:
                break
        expected = torch.zeros(8)
        expected[keep] = full[keep] / full[keep].sum()
        torch.testing.assert_close(_probs(LOGITS, top_p=top_p, filter_rows=filter_rows), expected)


@each_filter
def test_top_k_then_top_p_and_temperature_together(filter_rows):
    p = _probs(LOGITS, temperature=2.0, top_k=4, top_p=0.6, filter_rows=filter_rows)
    scaled = LOGITS / 2.0
    keep4 = scaled.topk(4).indices.tolist()
    sub = torch.softmax(scaled[keep4], dim=0)
    keep, mass = [], 0.0
    for i, pi in zip(keep4, sub.tolist(), strict=True):  # topk is sorted descending
        keep.append(i)
        mass += pi
        if mass >= 0.6:
            break
    expected = torch.zeros(8)
    expected[keep] = torch.softmax(scaled[keep], dim=0)
    torch.testing.assert_close(p, expected)


@each_filter
def test_rows_are_filtered_independently(filter_rows):
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    p = filter_rows(logits, torch.tensor([1.0, 0.5]), torch.tensor([2, 0]), torch.tensor([1.0, 0.9]))
    torch.testing.assert_close(p[0], _probs(LOGITS, top_k=2, filter_rows=filter_rows))
    torch.testing.assert_close(p[1], _probs(LOGITS.flip(0), temperature=0.5, top_p=0.9, filter_rows=filter_rows))


def _sorting_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The filter as first written: sort the whole row, cut top-k, then the top-p prefix."""
    scaled = logits / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.sort(descending=True).values[top_k - 1], float("-inf"))
    if top_p < 1.0:
        probs = scaled.softmax(dim=0)
        values, order = probs.sort(descending=True)
        drop = (values.cumsum(dim=0) - values) >= top_p
        drop[0] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
    return scaled.softmax(dim=0)


@each_filter
def test_the_filter_equals_a_sorting_reference_over_a_large_vocabulary(filter_rows):
    """Nuclei from one token to thousands (past every doubling of the candidates searched), top-k
    small and large, several settings in one batch: each row as the reference filters it alone."""
    gen = torch.Generator().manual_seed(5)
    vocab = 20000
    settings = [(0.3, 0, 0.9), (1.0, 0, 0.5), (2.0, 0, 0.95), (4.0, 0, 0.99), (1.0, 40, 1.0), (1.0, 3000, 0.97),
                (0.8, 40, 0.95), (1.5, 0, 1.0), (3.0, 0, 0.999)]
    logits = torch.randn(len(settings), vocab, generator=gen) * 3
    temperature, top_k, top_p = (torch.tensor(column) for column in zip(*settings, strict=True))
    probs = filter_rows(logits, temperature.float(), top_k, top_p.float())
    supports = []
    for row, (t, k, p) in enumerate(settings):
        expected = _sorting_reference(logits[row], t, k, p)
        assert torch.equal(probs[row] > 0, expected > 0), (t, k, p)
        torch.testing.assert_close(probs[row], expected)
        supports.append(int((expected > 0).sum()))
    assert min(supports) <= 5 and max(s for s in supports if s < vocab) > 2000, supports


@each_filter
def test_ties_at_the_top_p_boundary_are_kept_whatever_their_order(filter_rows):
    """The boundary falls inside a group of equal logits: the whole group is kept, as top-k keeps
    its ties, so the kept set does not depend on how a sort orders equal values."""
    logits = torch.tensor([0.0, 2.0, 0.0, 3.0, 0.0, -5.0])
    full = torch.softmax(logits, dim=0)
    top_p = float(full[3] + full[1] + full[0]) - 1e-4  # reached inside the three tokens at 0.0
    expected = torch.zeros(6)
    keep = [0, 1, 2, 3, 4]
    expected[keep] = torch.softmax(logits[keep], dim=0)
    torch.testing.assert_close(_probs(logits, top_p=top_p, filter_rows=filter_rows), expected)
    torch.testing.assert_close(_probs(logits.flip(0), top_p=top_p, filter_rows=filter_rows), expected.flip(0))


@each_filter
def test_a_row_without_top_p_keeps_its_whole_vocabulary_beside_a_row_with_it(filter_rows):
    """A row filters alike alone and in any batch. (The first filter cut the tail of a row with
    top_p 1 whenever another row of the batch had top_p < 1: its float32 running mass passed 1.0
    before the end of the row.)"""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3000, generator=gen) * 3
    together = filter_rows(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 0.5]))
    exact = dict(rtol=0, atol=0) if filter_rows is logits_to_probs else {}  # the kernel's exp is another's
    assert bool((together[0] > 0).all())
    torch.testing.assert_close(together[0], torch.softmax(logits[0], dim=0), **exact)
    assert torch.equal(together[1], _probs(logits[1], top_p=0.5, filter_rows=filter_rows))


@each_filter
def test_each_row_filters_alike_alone_and_in_any_batch(filter_rows):
    """Random batches mixing temperatures, top-k and top-p, with many tied logits: every row of
    the batch equals that row filtered alone, bit for bit (how many candidates the batch made the
    nucleus search take does not matter)."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(60):
        rows, vocab = 5, (7, 300, 3000)[trial % 3]
        logits = torch.randn(rows, vocab, generator=gen) * 3
        if trial % 2:
            logits = (logits * 2).round() / 2
        temperature = torch.rand(rows, generator=gen) + 0.3
        top_k = torch.randint(0, vocab + 3, (rows,), generator=gen) * (torch.rand(rows, generator=gen) < 0.5)
        top_p = torch.where(torch.rand(rows, generator=gen) < 0.6, torch.rand(rows, generator=gen) * 0.99 + 0.01,
                            torch.ones(rows))
        together = filter_rows(logits, temperature, top_k, top_p)
        for r in range(rows):
            alone = filter_rows(logits[r : r + 1], temperature[r : r + 1], top_k[r : r + 1], top_p[r : r + 1])
            assert torch.equal(together[r], alone[0]), (trial, r)


def test_the_draw_walks_blocks_and_never_draws_a_token_of_weight_zero():
    """Weight in a few tokens spread over many blocks of DRAW_BLOCK (the first and last token
    among them, whole blocks empty, a vocabulary no multiple of the block): chi-square against
    the weights, unnormalised, and a point rounded to the total lands on the last token of weight."""
    vocab = 3 * DRAW_BLOCK + 17
    weights = torch.zeros(vocab)
    heavy = {0: 1.0, 5: 3.0, DRAW_BLOCK: 2.0, 2 * DRAW_BLOCK + 100: 0.5, vocab - 1: 1.5}
    for token, w in heavy.items():
        weights[token] = w
    n = 30000
    gen = torch.Generator().manual_seed(7)
    tokens = sample_from_probs(weights.unsqueeze(0).expand(n, vocab).contiguous() * 3.0, [gen] * n)
    counts = torch.bincount(tokens, minlength=vocab).float()
    assert counts[weights == 0].sum() == 0
    expected = weights[weights > 0] / weights.sum() * n
    chi2 = (((counts[weights > 0] - expected) ** 2) / expected).sum().item()
    assert chi2 < 18.5, chi2  # 99.9% quantile of chi-square with 4 dof
    cumulative = torch.tensor([[0.0, 0.5, 0.5, 1.0, 1.0]], dtype=torch.float64)
    for point, index in ((0.0, 1), (0.5, 3), (0.99, 3), (1.0, 3)):
        assert _first_above(cumulative, torch.tensor([[point]], dtype=torch.float64)).item() == index


def test_sampler_matches_distribution_chi_square():
    probs = _probs(LOGITS, temperature=1.5, top_k=6)
    gen = torch.Generator().manual_seed(1234)
    n = 40000
    counts = torch.zeros(8)
    batch = probs.unsqueeze(0).expand(1000, 8).contiguous()
    for _ in range(n // 1000):
        gens = [gen] * 1000
        toks = sample_from_probs(batch, gens)
        counts += torch.bincount(toks, minlength=8).float()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a filtered-out token"
    expected = probs[support] * n
    chi2 = (((counts[support] - expected) ** 2) / expected).sum().item()
    dof = int(support.sum()) - 1
    # 99.9% quantile of chi-square with 5 dof is 20.5
    assert dof == 5 and chi2 < 20.5, chi2


def test_sampler_rejects_a_wrong_distribution():
    """The chi-square check above has power: samples from another distribution fail it."""
    probs = _probs(LOGITS, temperature=1.5, top_k=6)
    wrong = _probs(LOGITS, temperature=1.2, top_k=6)
    gen = torch.Generator().manual_seed(99)
    n = 40000
    toks = sample_from_probs(wrong.unsqueeze(0).expand(n, 8).contiguous(), [gen] * n)
    counts = torch.bincount(toks, minlength=8).float()
    support = probs > 0
    expected = probs[support] * n
    chi2 = (((counts[support] - expected) ** 2) / expected).sum().item()
    assert chi2 > 20.5


def test_same_generator_seed_same_samples():
    probs = _probs(LOGITS).unsqueeze(0).expand(4, 8).contiguous()
    a = sample_from_probs(probs, [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)])
    b = sample_from_probs(probs, [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)])
    assert a.tolist() == b.tolist()


@needs_kernel
def test_the_native_draw_is_the_pytorch_draw_with_the_same_uniforms():
    """Sampled rows go through the fused kernel (filter and draw); with the same generators every
    token is the PyTorch path's: logits_to_probs, then the blocks' inverse transform (a vocabulary
    no multiple of DRAW_BLOCK, peaked and flat rows, greedy, top-k and top-p rows in one batch)."""
    torch.manual_seed(0)
    vocab, n = 3 * DRAW_BLOCK + 45, 300
    logits = torch.randn(n, vocab) * torch.linspace(0.2, 12.0, n).unsqueeze(1)
    kinds = [dict(temperature=0.6), dict(temperature=1.0), dict(temperature=1.7), dict(temperature=0.0),
             dict(temperature=1.0, top_k=50), dict(temperature=0.8, top_p=0.9),
             dict(temperature=0.7, top_k=200, top_p=0.6), dict(temperature=1.3, top_k=3)]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(n)]
    probs = logits_to_probs(logits, torch.tensor([p.temperature or 1.0 for p in params]),
                            torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]))
    uniforms = torch.cat([torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(n)])
    drawn = _draw_blocks(probs, uniforms).tolist()
    expected = [int(logits[i].argmax()) if params[i].greedy else drawn[i] for i in range(n)]
    got = sample_tokens(logits, params, [torch.Generator().manual_seed(i) for i in range(n)])
    assert got == expected
    assert len(set(got)) > 100  # real draws, not a constant
    alone = [sample_tokens(logits[i : i + 1], [params[i]], [torch.Generator().manual_seed(i)])[0] for i in range(0, n, 7)]
    assert alone == got[::7]  # a row's draw does not depend on its batch


@needs_kernel
def test_the_native_draw_chooses_what_sample_tokens_chooses_step_by_step():
    """The kernel a call of several decode steps samples with (``sample_logit_rows``, fed by
    ``step_draws``) against ``sample_tokens`` one step at a time with the same generators: greedy
    rows (ties, NaN, -inf), temperature alone, top-k (0, 1, past the vocabulary), top-p and both,
    over three steps whose rows differ; a greedy row takes no uniform from its generator."""
    torch.manual_seed(1)
    vocab, n, steps = 2 * DRAW_BLOCK + 17, 96, 3
    kinds = [dict(temperature=0.0), dict(temperature=0.9), dict(temperature=1.0, top_k=1),
             dict(temperature=1.0, top_k=vocab + 5), dict(temperature=0.8, top_p=0.7),
             dict(temperature=1.4, top_k=40, top_p=0.9), dict(temperature=0.5, top_k=7)]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(n)]
    rows = [torch.randn(n, vocab) * torch.linspace(0.3, 9.0, n).unsqueeze(1) for _ in range(steps)]
    rows[0][0, 5] = rows[0][0, 9] = 50.0  # a tie: the first
    rows[1][7, 11] = math.nan  # a NaN: it
    rows[2][14, :] = -math.inf  # all -inf: the first
    expected_gens = [torch.Generator().manual_seed(i) for i in range(n)]
    expected = [sample_tokens(r, params, expected_gens) for r in rows]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    draws = step_draws(params, gens, steps, torch.device("cpu"))
    got = [native_kernels().sample_logit_rows(r, draws.temperature, draws.top_k, draws.top_p, draws.uniforms[s]).tolist()
           for s, r in enumerate(rows)]
    assert got == expected
    assert got[0][0] == 5 and got[1][7] == 11 and got[2][14] == 0
    assert len({t for step in got for t in step}) > 100  # real draws
    # each generator ends where the steps one at a time left it (a greedy row's untouched)
    assert draw_uniforms(gens, torch.device("cpu")).tolist() == draw_uniforms(expected_gens, torch.device("cpu")).tolist()
    assert draws.uniforms[:, 0].tolist() == [0.0] * steps and (draws.uniforms[:, 1] > 0).all()


def test_a_temperature_below_1e_5_decodes_greedily():
    """Below 1e-5 (vLLM's bound) a temperature is greedy: logits / t overflow float32 for the
    smallest, and 1e-46 is 0 in float32 (a division by zero had drawn at random)."""
    logits = torch.tensor([[0.5, 2.0, 1.0, -3.0]] * 64)
    for t in (1e-46, 1e-30, 9.9e-6):
        params = [SamplingParams(temperature=t)] * 64
        assert params[0].greedy
        assert sample_tokens(logits, params, [torch.Generator().manual_seed(i) for i in range(64)]) == [1] * 64
    assert not SamplingParams(temperature=1e-5).greedy


@needs_kernel
def test_the_native_weight_draw_is_the_pytorch_draw_with_the_same_uniforms():
    """sample_from_probs's kernel against its PyTorch form: filtered rows with whole blocks of zero
    weight, unnormalised rows, a one-token row, a vocabulary no multiple of DRAW_BLOCK; uniforms
    at 0 and just below 1 included. A token of weight 0 is never drawn."""
    torch.manual_seed(1)
    vocab, n = 5 * DRAW_BLOCK + 3, 400
    weights = torch.rand(n, vocab) ** 8 * torch.rand(n, 1) * 5
    weights[::3, DRAW_BLOCK : 3 * DRAW_BLOCK] = 0.0  # empty blocks
    weights[1::4] = weights[1::4] * (weights[1::4] > weights[1::4].quantile(0.99, dim=1, keepdim=True))  # a nucleus
    weights[5] = 0.0
    weights[5, vocab - 1] = 2.0  # one token, in the last (short) block
    uniforms = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    uniforms[0], uniforms[1] = 0.0, 1.0 - 2**-53
    got = native_kernels().sample_weight_rows(weights, uniforms)
    assert got.tolist() == _draw_blocks(weights, uniforms).tolist()
    assert bool((weights.gather(1, got.unsqueeze(1)) > 0).all()) and got[5] == vocab - 1
    assert len(set(got.tolist())) > 200


@needs_kernel
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (1.5, 0, 1.0), (1.2, 0, 0.8), (0.9, 5, 1.0),
                                                       (1.5, 6, 0.9)])
def test_the_native_draw_matches_the_distribution_chi_square(temperature, top_k, top_p):
    """The filtered softmax(LOGITS / T) by chi-square over 40000 draws (the exact probabilities
    enumerated by the filter's definition: the top_k largest, then the shortest prefix by
    probability reaching top_p), and a wrong temperature fails it."""
    n = 40000
    tokens = native_kernels().sample_logit_rows(LOGITS.expand(n, 8).contiguous(), torch.full((n,), temperature),
                                                torch.full((n,), top_k), torch.full((n,), top_p),
                                                torch.rand(n, dtype=torch.float64,
                                                           generator=torch.Generator().manual_seed(5)))
    counts = torch.bincount(tokens, minlength=8).double()

    def exact(t):
        order = (LOGITS.double() / t).argsort(descending=True).tolist()[: top_k or 8]
        kept, mass = [], 0.0
        full = torch.softmax(LOGITS.double()[order] / t, -1).tolist()
        for token, prob in zip(order, full, strict=True):
            if mass >= top_p:
                break
            kept.append(token)
            mass += prob
        probs = torch.zeros(8, dtype=torch.float64)
        probs[kept] = torch.softmax(LOGITS.double()[kept] / t, -1)
        return probs

    def chi2(probs):
        assert counts[probs == 0].sum() == 0, "a token outside the filter was drawn"
        expected = probs[probs > 0] * n
        return (((counts[probs > 0] - expected) ** 2) / expected).sum().item()

    kept = int((exact(temperature) > 0).sum())
    assert kept == min(top_k or 8, 8) if top_p == 1.0 else 1 < kept < (top_k or 8)  # the filter cut the row
    assert chi2(exact(temperature)) < 24.3  # 99.9% quantile of chi-square with at most 7 dof
    assert chi2(exact(temperature * 1.3)) > 24.3


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),  # was iterated into (1, 2)
        ({"stop_token_ids": [1.7]}, "stop_token_ids"),  # was truncated to (1,)
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": "no"}, "ignore_eos"),  # truthy: it turned EOS off
        ({"temperature": True}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"temperature": float("inf")}, "temperature"),
        ({"logprobs": 2.0}, "logprobs"),
    ],
)
def test_invalid_sampling_params_raise_value_error(kwargs, field):
    with pytest.raises(SpecforkError, match=field) as refused:
        SamplingParams(**kwargs)
    assert issubclass(SpecforkError, ValueError)
    assert refused.value.param == field  # what the server's error body names


def test_sampling_params_take_none_for_lists_and_numpy_numbers():
    import numpy as np

    p = SamplingParams(stop=None, stop_token_ids=None, temperature=np.float32(0.5), top_p=np.float64(0.9),
                       top_k=np.int64(5), max_tokens=np.int32(7), seed=np.uint64(3))
    assert p.stop == () and p.stop_token_ids == ()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (0.5, 0.9, 5, 7, 3)
    assert all(type(v) is t for v, t in ((p.temperature, float), (p.top_p, float), (p.top_k, int), (p.seed, int)))


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_a_seed_torch_cannot_take_is_refused(seed):
    """2**64 reached torch's manual_seed inside the server's engine loop and killed it."""
    with pytest.raises(SpecforkError, match="seed"):
        SamplingParams(seed=seed)


def test_every_seed_in_range_seeds_a_generator():
    for seed in (-(2**63), -1, 0, 2**63, 2**64 - 1):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)


def test_choice_seeds_are_reproducible_distinct_and_in_range():
    from specfork.sampling_params import SEED_MAX, choice_seed

    for seed in (0, 7, -(2**63), 2**64 - 1):
        seeds = [choice_seed(seed, i) for i in range(64)]
        assert seeds[0] == seed and len(set(seeds)) == 64
        assert seeds == [choice_seed(seed, i) for i in range(64)]
        assert all(0 <= s <= SEED_MAX for s in seeds[1:])
    assert choice_seed(7, 1) != choice_seed(8, 0) != choice_seed(8, 1)  # no overlap with the next seed


def test_valid_sampling_params():
    p = SamplingParams(temperature=0.0, top_p=1.0, stop="x", max_tokens=1)
    assert p.greedy and p.stop == ("x",)
    assert not math.isnan(SamplingParams(top_p=0.01).top_p)
