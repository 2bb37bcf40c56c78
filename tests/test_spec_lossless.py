"""Speculative sampling is lossless: with a draft unlike the target, the generated tokens follow
exactly the target's distribution (temperature, top-k, top-p applied identically), in the first
round and in later rounds. Exact probabilities come from enumerating the target's conditionals
over a vocabulary of 8 tokens; a chi-square test with a wrong acceptance rule must fail."""

import math
from collections import Counter
from itertools import product

import pytest
import torch
from conftest import _llama, randomize_

from specfork import LLM, SamplingParams
from specfork.layers.sampler import logits_to_probs
from specfork.spec import rejection
from specfork.spec import step as spec_step

VOCAB = 8
PROMPT = [1, 3, 5]
NUM_TOKENS = 5
NUM_SAMPLES = 12000


def _tiny(path, seed):
    torch.manual_seed(seed)
    model = _llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                   bos_token_id=1, eos_token_id=7, tie_word_embeddings=False).float().eval()
    randomize_(model, seed)
    with torch.no_grad():  # sharper conditionals: distributions far from uniform
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    target = _tiny(root / "target", seed=11)
    _tiny(root / "draft", seed=12)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "hf_target": target}


@torch.no_grad()
def exact_joint(hf_model, params: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """P(first n generated tokens) under the target, by enumerating every prefix."""
    joint = {(): 1.0}
    for _ in range(n):
        prefixes = list(joint)
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        logits = hf_model(ids).logits[:, -1].float()
        rows = len(prefixes)
        probs = logits_to_probs(logits, torch.full((rows,), params.temperature), torch.full((rows,), params.top_k),
                                torch.full((rows,), params.top_p))
        nxt = {}
        for p, row in zip(prefixes, probs.tolist(), strict=True):
            for tok, pr in enumerate(row):
                if pr > 0:
                    nxt[p + (tok,)] = joint[p] * pr
        joint = nxt
    return joint


def marginal(joint, positions):
    out = Counter()
    for seq, p in joint.items():
        out[tuple(seq[i] for i in positions)] += p
    return out


def chi_square(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, pooling cells expected below 5."""
    stat, dof, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for cell, p in probs.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        dof += 1
    impossible = sum(c for cell, c in counts.items() if cell not in probs)
    assert impossible == 0, f"{impossible} samples hit cells of probability 0"
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        dof += 1
    return stat, dof - 1


def chi2_quantile(dof: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: p = 0.0005)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def sample_sd(models, params_kw, *, k=3, n=NUM_SAMPLES, expect_rejections=True):
    llm = LLM(models["target"], mode="sd", draft=models["draft"], k=k, max_num_seqs=512,
              kv_cache_tokens=512 * 16)
    params = [SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, seed=i, **params_kw) for i in range(n)]
    outs = llm.generate([PROMPT] * n, params)
    assert all(len(o.token_ids) == NUM_TOKENS for o in outs)
    rounds = sum(o.metrics["spec_rounds"] for o in outs)
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    proposed = sum(o.metrics["draft_tokens_proposed"] for o in outs)
    if expect_rejections:  # (a broken verifier may accept everything)
        assert 0 < accepted < proposed, "the test needs both acceptances and rejections"
        assert rounds >= 2 * n, "later tokens must come from later verification rounds"
    return [tuple(o.token_ids) for o in outs]


def check(samples, joint):
    n = len(samples)
    results = {}
    for name, positions in (("tokens 1-3", (0, 1, 2)), ("tokens 3-5", (2, 3, 4))):
        counts = Counter(tuple(s[i] for i in positions) for s in samples)
        stat, dof = chi_square(counts, marginal(joint, positions), n)
        results[name] = (stat, dof, chi2_quantile(dof))
    return results


SETTINGS = {
    "temperature": dict(temperature=1.0),
    "top-k": dict(temperature=0.8, top_k=4),
    "top-p": dict(temperature=1.3, top_p=0.8),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sd_output_distribution_is_the_target_distribution(models, setting):
    params_kw = SETTINGS[setting]
    joint = exact_joint(models["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    for name, (stat, dof, limit) in check(sample_sd(models, params_kw), joint).items():
        assert stat < limit, f"{setting} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"


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
    """The chi-square check has the power to catch a broken verifier."""
    monkeypatch.setattr(spec_step, "verify_sampled", wrong_rule)
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


def test_exact_joint_sums_to_one(models):
    joint = exact_joint(models["hf_target"], SamplingParams(temperature=0.8, top_k=3), 3)
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-5)
    assert all(len(k) == 3 for k in joint) and len(joint) <= 27
    assert set(product(range(VOCAB), repeat=1)) >= {k[:1] for k in joint}
