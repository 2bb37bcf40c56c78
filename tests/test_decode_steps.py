"""Several decode steps in one native call (``--decode-steps``): the same tokens as one step at a
time, greedy or sampled (a seeded request's draws too), with penalties, logit bias, min_p and
min_tokens applied and log-probabilities taken inside the call; taken only where nothing is
adjusted in Python (a grammar, allowed ids, bad words), bounded by max_tokens and the model's
length."""

from __future__ import annotations

import pytest
import torch

from specfork import LLM, SamplingParams
from specfork.native_kernels import kernels
from specfork.sampling_params import StructuredOutputs

pytestmark = pytest.mark.skipif(kernels() is None, reason="needs the native CPU kernels (the one-call path)")

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    [{"role": "user", "content": "Give me three tips for writing clear emails."}],
    [{"role": "user", "content": "Write a Python function that reverses a linked list."}],
    "The capital of France is",
]


def encoded(llm: LLM) -> list[list[int]]:
    return [llm.engine.encode_chat(p) if isinstance(p, list) else llm.engine.encode_prompt(p) for p in PROMPTS]


class CallCounter:
    """Counts the runner's multi-step calls and the steps they ran (installed on one engine)."""

    def __init__(self, llm: LLM) -> None:
        self.calls, self.steps = 0, []
        runner = llm.engine.runner
        original = runner.decode_steps

        def counted(seqs, steps, draws):
            self.calls += 1
            self.steps.append(steps)
            return original(seqs, steps, draws)

        runner.decode_steps = counted


@pytest.fixture(scope="module")
def engines():
    one = LLM(decode_steps=1, kv_cache_tokens=4096)
    many = LLM(decode_steps=4, kv_cache_tokens=4096)
    assert many.engine.step_strategy.decode_steps == 4 and one.engine.step_strategy.decode_steps == 1
    return one, many


@pytest.mark.parametrize("batched", [False, True])
def test_decode_steps_give_the_tokens_of_one_step_at_a_time(engines, batched):
    one, many = engines
    counter = CallCounter(many)
    ids = encoded(one)
    params = SamplingParams(temperature=0.0, max_tokens=59, ignore_eos=True)  # the prefill's 1 + 14 x 4 + 2
    if batched:
        expected = [o.token_ids for o in one.generate(ids, params)]
        got = [o.token_ids for o in many.generate(ids, params)]
    else:
        expected = [one.generate([p], params)[0].token_ids for p in ids]
        got = [many.generate([p], params)[0].token_ids for p in ids]
    assert got == expected
    assert all(len(t) == 59 for t in got)
    assert counter.calls >= 15 and max(counter.steps) == 4 and min(counter.steps) == 2


SAMPLED = [SamplingParams(temperature=0.8, max_tokens=41, ignore_eos=True, seed=11),
           SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True),
           SamplingParams(temperature=1.3, top_p=0.9, max_tokens=41, ignore_eos=True, seed=12),
           SamplingParams(temperature=1.0, top_k=20, max_tokens=41, ignore_eos=True, seed=13)]


@pytest.mark.parametrize("batched", [False, True])
def test_sampled_decode_steps_draw_the_tokens_of_one_step_at_a_time(engines, batched):
    """Seeded requests (temperature alone, top-p, top-k) with a greedy one among them: each step's
    draw in the call takes the uniform one step at a time takes from the request's generator, so the
    tokens are the same, alone and in a batch."""
    one, many = engines
    counter = CallCounter(many)
    ids = encoded(one)
    if batched:
        expected = [o.token_ids for o in one.generate(ids, SAMPLED)]
        got = [o.token_ids for o in many.generate(ids, SAMPLED)]
    else:
        expected = [one.generate([p], [sp])[0].token_ids for p, sp in zip(ids, SAMPLED, strict=True)]
        got = [many.generate([p], [sp])[0].token_ids for p, sp in zip(ids, SAMPLED, strict=True)]
    assert got == expected
    assert counter.calls >= 10 and max(counter.steps) == 4
    # the draws are the requests' own: another seed draws another text
    reseeded = [SamplingParams(temperature=0.8, max_tokens=41, ignore_eos=True, seed=99)]
    assert many.generate(ids[:1], reseeded)[0].token_ids != got[0]


def test_a_sampled_request_moves_from_one_step_to_several_with_its_draws_in_order(engines):
    """Sharing its batch with a request that has bad words (one step a call), a sampled request
    decodes one step a call, then several once that one is done: the generator's uniforms are
    taken in the same order."""
    one, many = engines
    prompts = encoded(one)[1:3]
    params = [SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, bad_words=[" the"]),
              SamplingParams(temperature=0.8, max_tokens=48, ignore_eos=True, seed=21)]
    counter = CallCounter(many)
    got = many.generate(prompts, params)[1]
    assert got.token_ids == one.generate(prompts, params)[1].token_ids
    assert len(got.token_ids) == 48 and counter.calls > 0 and sum(counter.steps) <= 48 - 13


ADJUSTED = [dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=1.0, top_p=0.9, repetition_penalty=1.2),
            dict(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.4), dict(temperature=0.0, frequency_penalty=1.0),
            dict(temperature=1.0, min_p=0.1), dict(temperature=0.7, logit_bias={11: 5.0, 198: -3.0}, min_tokens=40),
            dict(temperature=1.0, top_k=20, repetition_penalty=0.9, presence_penalty=-0.5, min_p=0.05)]


@pytest.mark.parametrize("adjust", ADJUSTED, ids=lambda a: ",".join(a))
def test_adjusted_requests_take_decode_steps_with_the_tokens_of_one_step_at_a_time(engines, adjust):
    """Penalties, logit bias, min_p and min_tokens go along into the call (the kernels'
    ``LogitAdjustments``), each step's logits adjusted after the tokens before it: the same tokens
    as one step a call with ``adjust_logits_``, beside a plain request in the batch; and they adjust
    (another text than without them)."""
    one, many = engines
    ids = encoded(one)
    params = [SamplingParams(max_tokens=45, ignore_eos=True, seed=i, **adjust) for i in range(len(ids))]
    params[2] = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)  # nothing to adjust
    counter = CallCounter(many)
    got = [o.token_ids for o in many.generate(ids, params)]
    assert got == [o.token_ids for o in one.generate(ids, params)]
    assert counter.calls >= 10 and max(counter.steps) == 4
    unadjusted = [SamplingParams(max_tokens=45, ignore_eos=True, seed=i,
                                 **{k: v for k, v in adjust.items() if k in ("temperature", "top_p", "top_k")})
                  for i in range(len(ids))]
    assert [o.token_ids for o in many.generate(ids, unadjusted)] != got


def test_min_tokens_counts_down_inside_a_call(engines):
    """With EOS made the likeliest token by a logit bias, min_tokens alone keeps the output going:
    it ends at EOS right after min_tokens tokens, whichever step of a call that falls on."""
    one, many = engines
    prompt = encoded(one)[1]
    eos = min(many.engine.eos_token_ids)
    for min_tokens in (5, 6, 7, 8, 9):
        params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=min_tokens, logit_bias={eos: 100.0})
        counter = CallCounter(many)
        got = many.generate([prompt], params)[0]
        assert got.token_ids == one.generate([prompt], params)[0].token_ids
        assert got.finish_reason == "stop" and len(got.token_ids) == min_tokens + 1, min_tokens
        assert counter.calls >= 1


def test_decode_steps_stop_where_one_step_at_a_time_stops(engines):
    """At EOS and at a stop string the tokens a call computed past them are dropped."""
    one, many = engines
    ids = encoded(one)
    for params in (SamplingParams(temperature=0.0, max_tokens=200),
                   SamplingParams(temperature=0.0, max_tokens=200, stop=[".", "\n"], ignore_eos=True),
                   SamplingParams(temperature=0.9, max_tokens=200, stop=[".", "\n"], seed=5)):
        expected = one.generate(ids, params)
        got = many.generate(ids, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert [o.text for o in got] == [o.text for o in expected]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert any(o.finish_reason == "stop" for o in expected)


@pytest.mark.parametrize("batched", [False, True])
def test_log_probabilities_come_back_from_decode_steps_as_one_step_a_call_gives_them(engines, batched):
    """A request asking for log-probabilities takes the steps too: each step's numbers (its token's
    and the top alternatives', of the model's own logits before any adjustment) are one step a
    call's, equal to the last bit; greedy and sampled, with and without alternatives, under a
    penalty, beside a request that asks for none; cut where a stop string cuts the tokens."""
    one, many = engines
    ids = encoded(one)
    params = [SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=0.9, top_p=0.9, max_tokens=37, ignore_eos=True, seed=8, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=90, seed=9, logprobs=3, repetition_penalty=1.3,
                             stop=["\n"])]
    counter = CallCounter(many)
    if batched:
        got, expected = many.generate(ids, params), one.generate(ids, params)
    else:
        got = [many.generate([p], [q])[0] for p, q in zip(ids, params, strict=True)]
        expected = [one.generate([p], [q])[0] for p, q in zip(ids, params, strict=True)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.logprobs for o in got] == [o.logprobs for o in expected]
    assert counter.calls >= 8 and max(counter.steps) == 4
    assert got[2].logprobs is None and [len(o.logprobs) for o in got[:2]] == [37, 37]
    assert all(len(e.top) == 5 for e in got[0].logprobs) and all(e.top == () for e in got[1].logprobs)
    assert len(got[3].logprobs) == len(got[3].token_ids) and got[3].finish_reason == "stop"
    # of the model's own logits: the greedy token is the top alternative, its log-probability the top's
    assert all(e.token_id == e.top[0][0] and e.logprob == e.top[0][1] <= 0 for e in got[0].logprobs)


def test_a_request_with_something_to_adjust_in_python_decodes_one_step_at_a_time(engines):
    one, many = engines
    ids = encoded(one)[:2]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for other in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[" the"]),
                  SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True, seed=3,
                                 allowed_token_ids=list(range(20000)), repetition_penalty=1.2),
                  SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputs(regex="[a-z ]+"))):
        counter = CallCounter(many)
        got = many.generate(ids, [plain, other])
        expected = one.generate(ids, [plain, other])
        assert counter.calls == 0  # sharing a batch with such a request, the plain one waits for it
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_decode_steps_under_kv_pressure_with_uneven_requests(engines):
    """A cache too small for the batch (sequences preempted and recomputed), requests with
    different max_tokens in one batch (the shortest bounds a call), one that stops at a stop token
    id and two seeded sampled ones: the tokens of one step at a time."""
    one, _ = engines
    ids = encoded(one)
    stop_id = one.generate([ids[3]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids[9]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 7, 33)]
    params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]))
    # and sampled requests, seeded, whose calls are cut short by the others' and their own max_tokens
    params += [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=n, ignore_eos=True, seed=n) for n in (38, 10)]
    ids = ids + ids[:2]
    results = {}
    for steps in (1, 4):
        tight = LLM(decode_steps=steps, num_kv_blocks=10, block_size=16, max_num_seqs=6)
        counter = CallCounter(tight) if steps > 1 else None
        results[steps] = [o.token_ids for o in tight.generate(ids, params)]
        assert tight.engine.scheduler.num_preemptions > 0
    assert results[4] == results[1]
    assert [len(t) for t in results[4]][:3] == [40, 7, 33] and results[4][3][-1] == stop_id
    assert [len(t) for t in results[4]][4:] == [38, 10]
    assert counter.calls > 0


def test_decode_steps_end_at_the_models_length():
    """A request that reaches the model's length takes the last tokens it may, in a shorter call."""
    one = LLM(decode_steps=1, max_model_len=64, kv_cache_tokens=1024)
    many = LLM(decode_steps=4, max_model_len=64, kv_cache_tokens=1024)
    counter = CallCounter(many)
    prompt = one.engine.encode_prompt("def fibonacci(n):\n")
    params = SamplingParams(temperature=0.0, max_tokens=64 - len(prompt), ignore_eos=True)
    expected, got = one.generate([prompt], params)[0], many.generate([prompt], params)[0]
    assert got.token_ids == expected.token_ids and len(prompt) + len(got.token_ids) == 64
    assert counter.calls > 0 and sum(counter.steps) == len(got.token_ids) - 1  # the first token comes from the prefill


def test_decode_steps_keep_the_caches_whole_length():
    """Decode steps stop at the model's length, so plain decoding keeps every slot of a small cache
    (a verify window's k is cut from it in SD): requests run to the cache's length, whatever length
    their last call starts from."""
    many = LLM(decode_steps=4, num_kv_blocks=4, block_size=16)
    assert many.engine.max_model_len == 64 and many.engine.step_strategy.decode_steps == 4
    words = many.engine.encode_prompt("def fibonacci(n):\n    return n")
    for length in (5, 6, 7, 8):  # every residue of the steps, so one request's last call starts at 63
        prompt = words[:length]
        params = SamplingParams(temperature=0.0, max_tokens=64 - length, ignore_eos=True)
        out = many.generate([prompt], params)[0]
        assert len(prompt) + len(out.token_ids) == 64 and out.finish_reason == "length"


def test_decode_steps_in_deterministic_mode_equal_ar_one_step_at_a_time():
    one = LLM(decode_steps=1, deterministic=True, kv_cache_tokens=4096)
    many = LLM(decode_steps=3, deterministic=True, kv_cache_tokens=4096)
    ids = encoded(one)[1:3]
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    counter = CallCounter(many)
    assert [o.token_ids for o in many.generate(ids, params)] == [o.token_ids for o in one.generate(ids, params)]
    assert counter.calls == 8


def test_decode_steps_break_ties_as_the_sampler_does(tiny_checkpoints, tmp_path):
    """A tiny tied model whose embedding rows are all equal has every logit equal: each step's
    argmax is then the first token, as the sampler's (NumPy's, torch's) argmax chooses."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specfork.loading.gguf_export import export_gguf

    source = tiny_checkpoints["llama-gqa-tied"].path
    flat = tmp_path / "flat"
    shutil.copytree(source, flat)
    weights = load_file(flat / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embedding[5:6].expand_as(embedding).contiguous()
    save_file(weights, flat / "model.safetensors")
    path = export_gguf(flat, tmp_path / "flat-q8_0.gguf", vocab_from=None, out_type="q8_0")
    many = LLM(str(path), decode_steps=4, kv_cache_tokens=512)
    assert many.engine.step_strategy.decode_steps == 4
    counter = CallCounter(many)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    got = many.generate([[3, 7, 1]], params)[0].token_ids
    expected = LLM(str(path), decode_steps=1, kv_cache_tokens=512).generate([[3, 7, 1]], params)[0].token_ids
    assert got == expected == [0] * 9 and counter.calls == 2


COUNTS = ("spec_rounds", "spec_rounds_without_drafts", "spec_tokens_emitted", "draft_tokens_proposed",
          "draft_tokens_accepted")


class ForcedK:
    """Stands in for k auto's choice: each round's k from the running sequences' output lengths."""

    def __init__(self, llm: LLM, k_of) -> None:
        self.llm, self.k_of = llm, k_of
        auto_k = llm.engine.step_strategy.auto_k
        auto_k.ks_for_round = self.ks_for_round
        auto_k.plain_rounds = lambda: 32  # no probe or re-plan of its own to wait for

    def ks_for_round(self, batch: int = 1) -> list[int]:
        return [self.k_of(min(s.num_output_tokens for s in self.llm.engine.scheduler.running))] * batch


def test_sd_rounds_without_drafts_take_decode_steps_and_keep_the_heads_features():
    """Where k auto chooses plain decoding, SD decodes several steps a call too, and hands the
    proposer every position's features: after 32 plain tokens (8 calls of 4, or 32 of 1) the shipped
    head drafts the same chains, and the text is AR's."""
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    prompt = encoded(LLM(kv_cache_tokens=1024))[1]
    expected = LLM(deterministic=True, kv_cache_tokens=4096).generate([prompt], params)[0].token_ids
    runs = {}
    for steps in (1, 4):
        sd = LLM(mode="sd", decode_steps=steps, deterministic=True, kv_cache_tokens=4096)
        assert sd.engine.step_strategy.plain_steps == steps
        ForcedK(sd, lambda n: 0 if n < 33 else 4)
        proposals = []
        proposer = sd.engine.step_strategy.proposer
        original = proposer.propose

        def recorded(seqs, num_tokens, original=original, proposals=proposals):
            out = original(seqs, num_tokens)
            proposals.append((seqs[0].num_output_tokens, out.tokens[0]))
            return out

        proposer.propose = recorded
        counter = CallCounter(sd)
        out = sd.generate([prompt], params)[0]
        assert out.token_ids == expected
        assert counter.calls == (8 if steps == 4 else 0)
        assert out.metrics["spec_tokens_emitted"] == 69  # the prefill's token aside
        runs[steps] = proposals, {k: out.metrics[k] for k in COUNTS}
    assert runs[4] == runs[1] and runs[1][0][0][0] == 33
    assert runs[1][1]["spec_rounds_without_drafts"] >= 32  # a plain round per token, as one step a call counts
    assert sum(len(t) for _, t in runs[1][0]) >= 12  # the head drafted: its features were right


def test_sd_plain_steps_in_a_batch_hand_each_sequence_its_own_features(engines):
    """Rounds alternating between plain decoding (several steps a call) and drafting, a batch of
    greedy and seeded sampled requests: the greedy ones are AR's, every request ends where it
    should, and every position's features the proposer is handed are the ones one step a call
    hands it for that sequence and position (the call's rows come step by step; a sequence's must
    reach it in order)."""
    one, _ = engines
    ids = encoded(one)[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=4)]
    seen = {}
    for steps in (1, 4):
        sd = LLM(mode="sd", decode_steps=steps, deterministic=True, kv_cache_tokens=4096)
        ForcedK(sd, lambda n: 3 if n % 12 >= 8 else 0)
        counter = CallCounter(sd)
        features = seen[steps] = {}
        proposer = sd.engine.step_strategy.proposer
        original = proposer.observe_features

        def observed(seq, first, rows, original=original, features=features):
            for j, row in enumerate(rows):
                features[(ids.index(seq.prompt_token_ids), first + j)] = row.clone()
            original(seq, first, rows)

        proposer.observe_features = observed
        got = sd.generate(ids, params)
        assert [o.token_ids for o in got[:2]] == [o.token_ids for o in one.generate(ids[:2], params[:2])]
        assert [len(o.token_ids) for o in got] == [45, 30, 40]
        assert counter.calls > (3 if steps == 4 else -1)
    # the greedy requests' (the sampled one's text follows when its rounds drafted, which differs)
    common = {key for key in seen[1].keys() & seen[4].keys() if key[0] < 2}
    assert len(common) > 0.9 * len([key for key in seen[1] if key[0] < 2])
    assert [key for key in sorted(common) if not torch.equal(seen[1][key], seen[4][key])] == []


def test_sd_plain_steps_under_penalties_equal_ar(engines):
    """SD's plain rounds take a request's penalties, min_tokens and log-probabilities into the call
    as AR does; rounds that draft between them verify with the same adjustments: greedy, the text
    is AR's, and so are the log-probabilities, from the plain rounds' calls and the verify passes."""
    one, _ = engines
    ids = encoded(one)[:2]
    params = [SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, repetition_penalty=1.25),
              SamplingParams(temperature=0.0, max_tokens=50, min_tokens=20, frequency_penalty=0.6,
                             presence_penalty=0.3, logprobs=2)]
    sd = LLM(mode="sd", decode_steps=4, deterministic=True, kv_cache_tokens=4096)
    ForcedK(sd, lambda n: 3 if n % 16 >= 12 else 0)
    counter = CallCounter(sd)
    got = sd.generate(ids, params)
    expected = LLM(deterministic=True, kv_cache_tokens=4096).generate(ids, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert counter.calls >= 6 and max(counter.steps) == 4
    a, b = expected[1].logprobs, got[1].logprobs
    assert [e.token_id for e in b] == expected[1].token_ids and [[t for t, _ in e.top] for e in b] == [
        [t for t, _ in e.top] for e in a]
    assert [e.logprob for e in b] == pytest.approx([e.logprob for e in a], abs=1e-5)
    assert sum(o.metrics["draft_tokens_proposed"] for o in got) > 0  # verify passes reported some of them


def test_sd_plain_steps_that_stop_inside_a_call_count_their_rounds_and_cache_the_heads_rows():
    """A request stopping at a stop string inside a call of plain steps: its rounds count only the
    tokens kept (a plain round per token), and the head's rows of the whole text reach the prefix
    cache, so a conversation's next turn reuses as much of its prompt as with one step a call."""
    prompt = encoded(LLM(kv_cache_tokens=1024))[1]
    reused = {}
    for steps in (1, 4):
        sd = LLM(mode="sd", decode_steps=steps, kv_cache_tokens=4096)
        assert sd.engine.step_strategy.proposer.feature_layers  # the shipped head reads the target's features
        ForcedK(sd, lambda n: 0)
        counter = CallCounter(sd)
        first = sd.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200, stop=["\n\n"]))[0]
        m = first.metrics
        assert first.finish_reason == "stop" and len(first.token_ids) % 4 != 1  # 1 + calls of 4: it stops inside one
        assert (counter.calls > 0) == (steps > 1)
        assert m["spec_rounds"] == m["spec_rounds_without_drafts"] == m["spec_tokens_emitted"] == len(first.token_ids) - 1
        follow_up = prompt + first.token_ids + sd.engine.encode_prompt(" And then?")
        reused[steps] = sd.generate([follow_up], SamplingParams(temperature=0.0, max_tokens=2))[0].metrics[
            "num_cached_prompt_tokens"]
    assert reused[4] == reused[1] > len(prompt) + 32  # the prompt and the first answer's whole blocks


def test_decode_steps_must_be_positive_and_are_plain_decodings():
    from specfork.errors import SpecforkError

    with pytest.raises(SpecforkError, match="decode_steps must be an integer >= 1"):
        LLM(decode_steps=0)
    with pytest.raises(SpecforkError, match="decode_steps must be at most 32"):
        LLM(decode_steps=33)
    with pytest.raises(SpecforkError, match="SSD's rounds always verify drafts"):
        LLM(mode="ssd", decode_steps=2)
    with pytest.raises(SpecforkError, match="with a fixed --k every round verifies drafts"):
        LLM(mode="sd", k=3, decode_steps=2)
