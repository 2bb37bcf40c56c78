"""Shared by the chi-square losslessness tests (SD and SSD): a tiny target over a vocabulary of
8 tokens, the exact probabilities of its first tokens by enumerating every prefix, and the
chi-square check of sampled outputs against them."""

from __future__ import annotations

import math
from collections import Counter

import torch
from builders import llama, randomize_

from specfork import LLM, SamplingParams
from specfork.sampling import logits_to_probs

VOCAB = 8
EOS = 7
PROMPT = [1, 3, 5]
NUM_TOKENS = 5


def tiny_model(path, seed):
    torch.manual_seed(seed)
    model = llama(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                   bos_token_id=1, eos_token_id=EOS, tie_word_embeddings=False).float().eval()
    randomize_(model, seed)
    with torch.no_grad():  # sharper conditionals: distributions far from uniform
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def exact_joint(hf_model, params: SamplingParams, n: int) -> dict[tuple[int, ...], float]:
    """P(first n generated tokens) under the target, by enumerating every prefix."""
    joint = {(): 1.0}
    for _ in range(n):
        prefixes = list(joint)
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        logits = hf_model(ids).logits[:, -1].float()
        logits = torch.stack([reference_adjusted(row, prefix, params) for row, prefix in zip(logits, prefixes, strict=True)])
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


def reference_adjusted(logits: torch.Tensor, prefix: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The logits of one row after ``params``' penalties, min_tokens and min_p, written out token by
    token as vLLM documents them (min_p on the probabilities at the request's temperature)."""
    row = logits.clone()
    if params.allowed_token_ids:
        for token in set(range(len(row))) - set(params.allowed_token_ids):
            row[token] = float("-inf")
    if len(prefix) < params.min_tokens:
        for token in set(params.stop_token_ids) | (set() if params.ignore_eos else {EOS}):
            row[token] = float("-inf")
    for token, bias in params.logit_bias:
        row[token] += bias
    for token in set(PROMPT) | set(prefix):
        value = float(row[token])
        row[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(prefix).items():
        row[token] -= params.frequency_penalty * count + params.presence_penalty
    if params.min_p > 0:
        probs = torch.softmax(row / params.temperature, dim=-1)
        row[probs < params.min_p * probs.max()] = float("-inf")
    return row


def sampling_params(seed: int, params_kw: dict) -> SamplingParams:
    """A losslessness test's request: NUM_TOKENS tokens, EOS ignored unless the setting says."""
    return SamplingParams(**{"max_tokens": NUM_TOKENS, "ignore_eos": True, "seed": seed, **params_kw})


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
    # the adjustments that read the tokens before each position (drafts included, in a window)
    "penalties": dict(temperature=1.0, repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4,
                      logit_bias={2: 1.5, 6: -1.0}),
    # EOS held back at every position, token 4 never allowed, min_p with top-p after it
    "min-p": dict(temperature=1.3, min_p=0.1, top_p=0.9, min_tokens=NUM_TOKENS, ignore_eos=False,
                  allowed_token_ids=(0, 1, 2, 3, 5, 6, 7)),
}


def ssd_models(root) -> dict:
    """The SD test's target, and as draft a noisy copy of it: close enough that corrections
    often land on cached branches (hits), far enough for rejections."""
    target = tiny_model(root / "target", seed=11)
    draft = tiny_model(root / "draft", seed=12)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p, q in zip(draft.parameters(), target.parameters(), strict=True):
            p.copy_(q + 0.5 * q.std() * torch.randn(q.shape, generator=gen))
    draft.save_pretrained(root / "draft", safe_serialization=True)
    return {"target": str(root / "target"), "draft": str(root / "draft"), "hf_target": target}


def sample_ssd(models, params_kw, backup, saguaro, num_samples, device="cpu", **options):
    """``num_samples`` SSD generations of PROMPT; checks that hits and misses, acceptances and
    rejections all occurred and that the drafter process never failed. ``options``: more engine
    options (tensor parallelism, the drafter as a rank)."""
    llm = LLM(models["target"], mode="ssd", draft=models["draft"], k=3, fan_out=2, backup=backup,
              saguaro_x=saguaro, max_num_seqs=512, kv_cache_tokens=512 * 16, device=device, **options)
    params = [sampling_params(i, params_kw) for i in range(num_samples)]
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
