"""Log-probabilities: the target's raw log-softmax, for prompt and output tokens, the same numbers
in AR, SD and SSD."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import prefill_logits

from specfork import LLM, SamplingParams, SpecforkError
from specfork.layers.logprobs import token_logprobs

PROMPTS = [[1, 5, 9, 13, 2, 7, 30, 31], [1, 44, 3], [1, 8, 8, 8, 8, 8, 8, 8, 8, 20, 21]]


def test_token_logprobs_on_an_enumerated_vocabulary():
    logits = torch.tensor([[0.0, math.log(3.0), -1.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    chosen, ids, values = token_logprobs(logits, torch.tensor([1, 2]), top=2)
    z = 1 + 3 + math.exp(-1) + math.exp(2)
    assert chosen.tolist() == pytest.approx([math.log(3 / z), math.log(1 / 4)])
    assert ids[0].tolist() == [3, 1]
    assert values[0].tolist() == pytest.approx([2 - math.log(z), math.log(3 / z)])
    assert values[1].tolist() == pytest.approx([math.log(1 / 4)] * 2)
    none = token_logprobs(logits, torch.tensor([0, 0]), top=0)
    assert none[1].shape == (2, 0) and none[2].shape == (2, 0)


def test_logprobs_settings_are_validated():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(SpecforkError, match="logprobs"):
            SamplingParams(logprobs=bad)
        with pytest.raises(SpecforkError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return str(tiny_checkpoints["llama-gqa-tied"].path)


@pytest.mark.parametrize("sampled", [False, True])
def test_logprobs_are_the_raw_log_softmax_of_the_target(target, sampled):
    """Against a full forward over prompt + output: every output token and every prompt token
    from the second on, with the top alternatives; sampling filters do not change them."""
    llm = LLM(target, deterministic=True, max_num_batched_tokens=4)  # prompts prefilled in chunks
    params = SamplingParams(temperature=0.7 if sampled else 0.0, top_k=3 if sampled else 0, seed=4,
                            max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for out in llm.generate(PROMPTS, params):
        tokens = out.prompt_token_ids + out.token_ids
        reference = prefill_logits(llm, tokens).log_softmax(dim=-1)  # row p: the distribution of token p + 1
        n_prompt = len(out.prompt_token_ids)
        assert len(out.prompt_logprobs) == n_prompt - 1 and len(out.logprobs) == len(out.token_ids)
        for position, entry in enumerate(out.prompt_logprobs + out.logprobs, start=1):
            row = reference[position - 1]
            assert entry.token_id == tokens[position]
            assert entry.logprob == pytest.approx(float(row[tokens[position]]), abs=1e-4)
            top = row.topk(2 if position < n_prompt else 3)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_no_logprobs_unless_asked(target):
    out = LLM(target).generate(PROMPTS[:1], SamplingParams(max_tokens=3))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


@pytest.mark.dist
@pytest.mark.parametrize("draft", ["llama-gqa-tied", "qwen3-qknorm-tied"])  # all accepted / mostly rejected
def test_sd_and_ssd_report_the_same_logprobs_as_ar(tiny_checkpoints, target, draft):
    """SD and SSD take them from the verify pass: accepted drafts, the recovered and the bonus
    token all get the target's numbers for that position, equal to AR's."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4)
    draft_path = str(tiny_checkpoints[draft].path)
    expected = LLM(target, deterministic=True).generate(PROMPTS, params)
    for mode in ("sd", "ssd"):
        with LLM(target, mode=mode, draft=draft_path, k=3, deterministic=True) as llm:
            got = llm.generate(PROMPTS, params)
        for a, b in zip(expected, got, strict=True):
            assert b.token_ids == a.token_ids, mode
            assert [e.token_id for e in b.logprobs] == a.token_ids
            assert [e.logprob for e in b.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-5)
            assert [[t for t, _ in e.top] for e in b.logprobs] == [[t for t, _ in e.top] for e in a.logprobs]
        proposed = sum(o.metrics["draft_tokens_proposed"] for o in got)
        accepted = sum(o.metrics["draft_tokens_accepted"] for o in got)
        assert proposed > 0
        assert accepted == proposed if draft == "llama-gqa-tied" else accepted < proposed, (mode, accepted, proposed)
