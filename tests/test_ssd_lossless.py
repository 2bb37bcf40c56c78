"""SSD sampling is lossless: tokens from cache hits, jit and fast misses, with and without
Saguaro reshaping, follow exactly the target's distribution (chi-square against exact
probabilities over a vocabulary of 8, tokens 1-3 and 3-5, so later rounds count)."""

import pytest
import torch
from lossless import NUM_TOKENS, PROMPT, SETTINGS, check, exact_joint, tiny_model

from specfork import LLM, SamplingParams

pytestmark = pytest.mark.dist

SAMPLES = [6000, pytest.param(24000, marks=pytest.mark.slow)]  # default / the long version

CASES = {  # backup, Saguaro coefficient, sampling setting
    "jit": ("jit", None, "temperature"),
    "jit-saguaro": ("jit", 0.5, "temperature"),
    "fast": ("fast", None, "temperature"),
    "fast-saguaro-top-p": ("fast", 0.5, "top-p"),
    "jit-top-k": ("jit", None, "top-k"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The SD test's target, and as draft a noisy copy of it: close enough that corrections
    often land on cached branches (hits), far enough for rejections."""
    root = tmp_path_factory.mktemp("ssd_lossless")
    target = tiny_model(root / "target", seed=11)
    draft = tiny_model(root / "draft", seed=12)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p, q in zip(draft.parameters(), target.parameters(), strict=True):
            p.copy_(q + 0.5 * q.std() * torch.randn(q.shape, generator=gen))
    draft.save_pretrained(root / "draft", safe_serialization=True)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "hf_target": target}


def sample_ssd(models, params_kw, backup, saguaro, num_samples):
    llm = LLM(models["target"], mode="ssd", draft=models["draft"], k=3, fan_out=2, backup=backup,
              saguaro_x=saguaro, max_num_seqs=512, kv_cache_tokens=512 * 16)
    params = [SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, seed=i, **params_kw) for i in range(num_samples)]
    try:
        outs = llm.generate([PROMPT] * num_samples, params)
        assert llm.engine.step_strategy.proposer.failure is None
    finally:
        llm.close()
    m = [o.metrics for o in outs]
    hits = sum(x["ssd_cache_hits"] for x in m)
    requests = sum(x["ssd_requests"] for x in m)
    accepted = sum(x["draft_tokens_accepted"] for x in m)
    proposed = sum(x["draft_tokens_proposed"] for x in m)
    # Hits and misses after the first round both occur; acceptances and rejections both occur.
    assert num_samples // 10 < hits < requests - num_samples - num_samples // 10, (hits, requests)
    assert 0 < accepted < proposed
    return [tuple(o.token_ids) for o in outs]


@pytest.mark.parametrize("num_samples", SAMPLES)
@pytest.mark.parametrize("case", list(CASES))
def test_ssd_output_distribution_is_the_target_distribution(models, case, num_samples):
    backup, saguaro, setting = CASES[case]
    params_kw = SETTINGS[setting]
    joint = exact_joint(models["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    for name, (stat, dof, limit) in check(sample_ssd(models, params_kw, backup, saguaro, num_samples), joint).items():
        assert stat < limit, f"{case} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"
