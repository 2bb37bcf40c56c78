"""Scheduling, KV-cache exhaustion, preemption, seeds and stop conditions on a tiny model."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfork import LLM, PromptError, SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=95, bos_token_id=1,
    )
    path = tmp_path_factory.mktemp("tiny_engine")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 44, 3], [1, 8, 8, 8, 8, 8, 8, 8, 8, 20, 21], [1, 60], [1, 2, 3, 4, 5, 6, 7],
           [1, 33, 34, 35, 36]]


def _alone(llm, prompts, params):
    return [llm.generate([p], params)[0].token_ids for p in prompts]


def test_kv_exhaustion_preempts_and_outputs_match_running_alone(tiny_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(tiny_dir, block_size=4, num_kv_blocks=256)
    expected = _alone(roomy, PROMPTS, greedy)
    # 10 blocks of 4 tokens = 40 slots; six requests need up to 35 tokens each at once.
    tight = LLM(tiny_dir, block_size=4, num_kv_blocks=10)
    outs = tight.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs] == expected
    assert tight.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert tight.engine.block_manager.num_used_blocks == 0, "blocks leaked"
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)


def test_kv_exhaustion_with_seeded_sampling(tiny_dir):
    params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=20, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    roomy = LLM(tiny_dir, block_size=4, num_kv_blocks=256)
    expected = [roomy.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    tight = LLM(tiny_dir, block_size=4, num_kv_blocks=9)
    outs = tight.generate(PROMPTS, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected


@pytest.mark.parametrize("budget", [2, 5, 16])
def test_chunked_prefill_under_kv_pressure_finishes_every_request(tiny_dir, budget):
    """A prompt prefilled in chunks waits at the head of the queue holding its blocks; sequences
    preempted meanwhile went in front of it, and once nothing ran, the new head could not get the
    blocks the partly prefilled one held: "KV cache too small", and the whole batch failed."""
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [[1 + (7 * i) % 90 for i in range(n)] for n in (90, 60, 40, 75, 20)]
    expected = _alone(LLM(tiny_dir), prompts, greedy)
    tight = LLM(tiny_dir, block_size=4, num_kv_blocks=32, max_num_batched_tokens=budget)
    assert [o.token_ids for o in tight.generate(prompts, greedy)] == expected
    assert tight.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert tight.engine.block_manager.num_used_blocks == 0, "blocks leaked"


def test_max_num_seqs_and_chunked_prefill(tiny_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = LLM(tiny_dir)
    expected = _alone(base, PROMPTS, greedy)
    limited = LLM(tiny_dir, max_num_seqs=2, max_num_batched_tokens=4, block_size=4)
    assert [o.token_ids for o in limited.generate(PROMPTS, greedy)] == expected


def test_same_seed_same_output_whatever_the_batch(tiny_dir):
    llm = LLM(tiny_dir)
    p = SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, seed=8, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], p)[0].token_ids
    batched = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [other, p, other])
    assert batched[1].token_ids == alone
    assert batched[0].token_ids != alone or batched[2].token_ids != alone
    different_seed = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=16, seed=9))[0]
    assert different_seed.token_ids != alone


def test_stop_token_ids_and_eos(tiny_dir):
    llm = LLM(tiny_dir)
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    stop_tok = free[4]
    first = free.index(stop_tok)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_tok,)))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    # EOS (id 95) stops a request unless ignore_eos.
    llm.engine.eos_token_ids = frozenset({stop_tok})
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == free and out.finish_reason == "length"


def test_output_metrics_fields(tiny_dir):
    out = LLM(tiny_dir).generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    m = out.metrics
    assert m["num_prompt_tokens"] == 3 and m["num_generated_tokens"] == 5
    assert m["time_s"] > 0 and m["ttft_s"] > 0 and m["tpot_s"] > 0
    assert out.prompt_token_ids == [1, 2, 3]


def test_prompt_plus_max_tokens_must_fit_the_context(tiny_dir):
    llm = LLM(tiny_dir, max_model_len=20)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True))[0]
    assert len(out.token_ids) == 17 and out.finish_reason == "length"
    # prompt + max_tokens beyond max_model_len is refused up front, naming both numbers
    with pytest.raises(PromptError, match=r"prompt \(3 tokens\) plus max_tokens \(18\) is 21 tokens.*max_model_len 20"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=18))


def test_a_failed_batch_fails_its_requests_and_leaves_the_engine_consistent(tiny_dir, monkeypatch):
    llm = LLM(tiny_dir)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([[1, 2, 3]], params)[0].token_ids
    step, engine = llm.engine.step_strategy, llm.engine
    real, calls = step.execute, []

    def execute_once_broken(batch):
        calls.append(batch)
        if len(calls) == 2:  # the first decode step
            raise RuntimeError("boom")
        return real(batch)

    monkeypatch.setattr(step, "execute", execute_once_broken)
    seq = engine.add_request([1, 2, 3], params)
    updates = engine.step() + engine.step()  # prefill, then the failing decode
    failed = [u for u in updates if u.error is not None]
    assert [u.seq for u in failed] == [seq] and failed[0].finished
    assert seq.is_finished and engine.output(seq).finish_reason == "error"
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()

    def always_broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(step, "execute", always_broken)
    with pytest.raises(RuntimeError, match="generation failed"):  # offline, a failure is an error
        llm.generate([[1, 2, 3]], params)
    monkeypatch.setattr(step, "execute", real)
    assert llm.generate([[1, 2, 3]], params)[0].token_ids == expected
