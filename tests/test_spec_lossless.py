"""Speculative sampling is lossless: with a draft unlike the target, the generated tokens follow
exactly the target's distribution (temperature, top-k, top-p applied identically), in the first
round and in later rounds. Exact probabilities come from enumerating the target's conditionals
over a vocabulary of 8 tokens; a chi-square test with a wrong acceptance rule must fail."""

from collections import Counter
from itertools import product

import pytest
import torch
from lossless import NUM_TOKENS, PROMPT, SETTINGS, VOCAB, check, exact_joint, sampling_params, tiny_model

from specfork import LLM, SamplingParams
from specfork.native_kernels import kernels as native_kernels
from specfork.sampling import logits_to_probs
from specfork.speculative import rejection, sd_step

NUM_SAMPLES = 12000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    target = tiny_model(root / "target", seed=11)
    tiny_model(root / "draft", seed=12)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "hf_target": target}


def sample_sd(models, params_kw, *, k=3, n=NUM_SAMPLES, expect_rejections=True):
    llm = LLM(models["target"], mode="sd", draft=models["draft"], k=k, max_num_seqs=512,
              kv_cache_tokens=512 * 16)
    params = [sampling_params(i, params_kw) for i in range(n)]
    outs = llm.generate([PROMPT] * n, params)
    assert all(len(o.token_ids) == NUM_TOKENS for o in outs)
    rounds = sum(o.metrics["spec_rounds"] for o in outs)
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    proposed = sum(o.metrics["draft_tokens_proposed"] for o in outs)
    if expect_rejections:  # (a broken verifier may accept everything)
        assert 0 < accepted < proposed, "the test needs both acceptances and rejections"
        assert rounds >= 2 * n, "later tokens must come from later verification rounds"
    return [tuple(o.token_ids) for o in outs]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sd_output_distribution_is_the_target_distribution(models, setting, monkeypatch):
    params_kw = SETTINGS[setting]
    from_logits = []  # sequences verified by the native kernel (every sampled request, when it is built)
    monkeypatch.setattr(sd_step, "verify_sampled_logits",
                        lambda *a: from_logits.append(1) or rejection.verify_sampled_logits(*a))
    joint = exact_joint(models["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    for name, (stat, dof, limit) in check(sample_sd(models, params_kw), joint).items():
        assert stat < limit, f"{setting} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"
    assert bool(from_logits) == (native_kernels() is not None)


def _always_accept(target_probs, proposed, draft_probs, generator):
    n = proposed.shape[0]
    noise = torch.empty_like(target_probs[n]).exponential_(generator=generator)
    return rejection.VerifyResult(n, proposed.tolist() + [int((target_probs[n] / noise).argmax())])


def _resample_from_target(target_probs, proposed, draft_probs, generator):
    """Correct acceptance test, but a rejected position is resampled from p, not the residual."""
    result = rejection.verify_sampled(target_probs, proposed, draft_probs, generator)
    m = result.num_accepted
    if m < proposed.shape[0]:
        noise = torch.empty_like(target_probs[m]).exponential_(generator=generator)
        result.tokens[-1] = int((target_probs[m] / noise).argmax())
    return result


@pytest.mark.parametrize("wrong_rule", [_always_accept, _resample_from_target])
def test_wrong_acceptance_rules_fail_the_test(models, monkeypatch, wrong_rule):
    """The chi-square check has the power to catch a broken verifier (on either path: the request
    is verified from its logits where the native kernel is built)."""
    monkeypatch.setattr(sd_step, "verify_sampled", wrong_rule)
    monkeypatch.setattr(sd_step, "verify_sampled_logits", lambda logits, params, proposed, q, generator, kernels:
                        wrong_rule(torch.softmax(logits / params.temperature, dim=-1), proposed, q, generator))
    params_kw = SETTINGS["temperature"]
    joint = exact_joint(models["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    results = check(sample_sd(models, params_kw, expect_rejections=False), joint)
    assert any(stat > limit for stat, _, limit in results.values()), results


def test_verify_sampled_single_position_exact():
    """Unit level: for one proposal, P(emitted token) equals p exactly (many draws, V = 3)."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.2, 0.7, 0.1]])
    gen = torch.Generator().manual_seed(0)
    counts = Counter()
    n = 30000
    draft_gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=draft_gen)
        r = rejection.verify_sampled(p, x, q, gen)
        counts[r.tokens[0]] += 1
    stat = sum((counts[t] - p[0, t].item() * n) ** 2 / (p[0, t].item() * n) for t in range(3))
    assert stat < 15.2  # chi2(2) at p = 0.0005
    # one-hot proposals (n-gram): accept with p(x), else p without x
    counts = Counter()
    for _ in range(n):
        r = rejection.verify_sampled(p, torch.tensor([1]), None, gen)
        counts[r.tokens[0]] += 1
    stat = sum((counts[t] - p[0, t].item() * n) ** 2 / (p[0, t].item() * n) for t in range(3))
    assert stat < 15.2


@pytest.mark.skipif(native_kernels() is None, reason="native kernels need a C++ compiler")
@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=40), dict(top_p=0.8), dict(top_k=300, top_p=0.6)],
                         ids=["temperature", "top-k", "top-p", "top-k-top-p"])
def test_verification_from_logits_is_verify_sampled_with_the_same_uniforms(one_hot, filters):
    """The native verification takes the very decisions and draws verify_sampled takes on the
    probabilities the PyTorch filter gives (temperature, top-k, top-p), uniform for uniform: accepted
    prefixes of every length, recovered tokens (from the residual, or p without a one-hot proposal)
    and bonus tokens, over a vocabulary of several draw blocks. Proposals outside the target's
    filter are rejected."""
    vocab, n = 1000, 4
    params = SamplingParams(temperature=0.7, **filters)
    filter_args = (torch.tensor([params.temperature]), torch.tensor([params.top_k]), torch.tensor([params.top_p]))
    torch.manual_seed(0)
    outcomes = Counter()
    for trial in range(300):
        logits = torch.randn(n + 1, vocab) * (2 + 4 * (trial % 3))  # peaked rows accept long prefixes
        p = torch.cat([logits_to_probs(row.unsqueeze(0), *filter_args) for row in logits])
        if one_hot:  # deterministic proposals (n-gram lookup): the target's likeliest token, or another
            q = None
            proposed = torch.where(torch.rand(n) < 0.8, p[:n].argmax(dim=-1), torch.randint(vocab, (n,)))
        else:  # drafts near the target, unfiltered
            q = torch.softmax(logits[:n] / params.temperature + torch.randn(n, vocab) * (trial % 4) * 0.5, dim=-1)
            proposed = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(trial)).squeeze(1)
        want = rejection.verify_sampled(p, proposed, q, torch.Generator().manual_seed(10_000 + trial))
        got = rejection.verify_sampled_logits(logits, params, proposed, q, torch.Generator().manual_seed(10_000 + trial),
                                              native_kernels())
        assert (got.num_accepted, got.tokens) == (want.num_accepted, want.tokens), trial
        assert all(p[j, token] > 0 for j, token in enumerate(got.tokens))
        outcomes[want.num_accepted] += 1
    assert set(outcomes) == set(range(n + 1)), outcomes  # every prefix length, bonus included


def test_a_proposal_outside_the_target_filter_is_rejected_even_at_a_zero_uniform(monkeypatch):
    """p(x) = 0 (top-k removed x): u * q(x) <= p(x) holds at u = 0, a draw torch.rand can make, yet
    x must never be accepted, on either path."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: real_rand(*a, **kw) * (kw.get("dtype") == torch.float64))
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.5, 1.0, 1.5]])
    params = SamplingParams(temperature=1.0, top_k=2)  # token 0 is outside the first row's filter
    p = logits_to_probs(logits, torch.tensor([1.0, 1.0]), torch.tensor([2, 2]), torch.tensor([1.0, 1.0]))
    q = torch.tensor([[0.5, 0.25, 0.25]])
    results = [rejection.verify_sampled(p, torch.tensor([0]), q, torch.Generator().manual_seed(0))]
    if native_kernels() is not None:
        results.append(rejection.verify_sampled_logits(logits, params, torch.tensor([0]), q,
                                                       torch.Generator().manual_seed(0), native_kernels()))
    for result in results:
        assert result.num_accepted == 0 and result.tokens[0] in (1, 2)


def test_exact_joint_sums_to_one(models):
    joint = exact_joint(models["hf_target"], SamplingParams(temperature=0.8, top_k=3), 3)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-5)
    assert all(len(k) == 3 for k in joint) and len(joint) <= 27
    assert set(product(range(VOCAB), repeat=1)) >= {k[:1] for k in joint}
