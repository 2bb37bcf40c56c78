"""Logit adjustments (allowed ids, bad words, min_tokens, logit bias, penalties, min_p): the logits
every mode samples and verifies from, checked by hand, against transformers' own processors, and
through speculation (greedy SD and SSD equal AR with them; the chi-square tests in
test_spec_lossless / test_ssd_lossless / test_eagle3 cover sampling)."""

import math

import pytest
import torch
from builders import build_tiny_checkpoint
from helpers import assert_greedy_match
from lossless import EOS, PROMPT

from specfork import LLM, SamplingParams, SpecforkError
from specfork.native_kernels import kernels as native_kernels
from specfork.sampling import TokenHistory, adjust_logits_, step_adjustments
from specfork.speculative.proposer import Proposal, StatelessProposer

INF = float("inf")


def adjusted(logits: torch.Tensor, histories: list[TokenHistory]) -> torch.Tensor:
    out = logits.clone()
    adjust_logits_(out, histories)
    return out


def test_each_adjustment_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3)
    history = TokenHistory(params, token_ids=[0, 1, 3, 3], num_prompt_tokens=2, stop_ids=frozenset({5, 9}))
    # token 0 (prompt, positive) halved; 1 (prompt, negative) doubled; 3 (output twice, positive)
    # halved then 2 x 0.5 + 0.25 taken off; 5 held back (2 tokens out of min_tokens 3); 9 is past the vocabulary
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0 / 2 - 1.0 - 0.25, -2.0, -INF]])
    assert torch.equal(adjusted(logits, [history]), expected)
    # min_p at temperature 2: the largest logit 3, kept: logits >= 3 + 2 log(0.2) = -0.22
    min_p = TokenHistory(SamplingParams(temperature=2.0, min_p=0.2), [0], 1, frozenset())
    assert torch.equal(adjusted(logits, [min_p]), torch.tensor([[2.0, -INF, 0.5, 3.0, -INF, 1.0]]))
    # greedy: min_p changes nothing the argmax sees, so it is not applied; nor is a min_tokens passed
    # or with nothing to hold back: such rows are left alone
    for params, output, stops in ((SamplingParams(temperature=0.0, min_p=0.9), [], {5}),
                                  (SamplingParams(min_tokens=2), [1, 1], {5}), (SamplingParams(min_tokens=2), [], set())):
        history = TokenHistory(params, [0, *output], 1, frozenset(stops))
        assert not history.adjusts
        assert torch.equal(adjusted(logits, [history]), logits)


def test_rows_off_the_cpu_or_not_float32_are_adjusted_through_a_copy_and_written_back():
    """(The path CUDA logits take; float64 rows on the CPU take it too.) A forward's logits are
    inference tensors, which only inference mode may change in place."""
    with torch.inference_mode():
        logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]], dtype=torch.float64)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=3)
    history = TokenHistory(params, token_ids=[0, 1, 3, 3], num_prompt_tokens=2, stop_ids=frozenset({5}))
    adjust_logits_(logits, [history])
    assert logits.dtype == torch.float64
    assert torch.equal(logits, torch.tensor([[1.0, -2.0, 0.5, 3.0 / 2 - 1.0 - 0.25, -2.0, -INF]], dtype=torch.float64))


def test_only_the_adjusting_rows_change_and_raw_copies_are_kept_where_asked():
    """Raw rows are copied for the requests that asked for log-probabilities, where they changed."""
    logits = torch.randn(6, 6)
    histories = [TokenHistory(SamplingParams(logprobs=1), [0], 1, frozenset()),  # row 0
                 TokenHistory(SamplingParams(logit_bias={1: 2.0}, logprobs=0), [0], 1, frozenset(), drafts=[3, 3]),
                 TokenHistory(SamplingParams(logit_bias={2: 2.0}), [0], 1, frozenset()),  # row 4
                 TokenHistory(SamplingParams(), [0], 1, frozenset())]  # row 5
    out = logits.clone()
    raw = adjust_logits_(out, histories)  # window 1: rows 1-3
    assert list(raw) == [1] and torch.equal(raw[1], logits[1:4])  # window 0 did not change: no copy
    assert torch.equal(out[[0, 5]], logits[[0, 5]])
    assert torch.equal(out[1:4, 1], logits[1:4, 1] + 2.0) and out[4, 2] == logits[4, 2] + 2.0
    changed = out != logits
    assert changed.sum() == 4


def test_allowed_token_ids_and_logit_bias_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [0.0, 1.0, 2.0, 3.0]])
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 2], logit_bias={"2": -0.5, 1: 100})
    history = TokenHistory(params, [0], 1, frozenset(), drafts=[2])
    assert torch.equal(adjusted(logits, [history]), torch.tensor([[-INF, 99.0, 0.0, -INF], [-INF, 101.0, 1.5, -INF]]))
    assert params.logit_bias == ((1, 100.0), (2, -0.5))


def test_bad_words_hold_back_their_last_token_where_their_first_tokens_end_the_history():
    logits = torch.zeros(3, 10)
    words = [(7,), (5, 9), (9, 4, 2), (6, 6, 3)]
    window = TokenHistory(SamplingParams(), [1, 2, 5], 1, frozenset(), drafts=[9, 4], bad_words=words)
    banned = (adjusted(logits, [window]) == -INF).nonzero().tolist()
    # every row: 7; row 0 (after ... 5): 9; row 2 (after ... 9, 4): 2; (6, 6) never precedes
    assert banned == [[0, 7], [0, 9], [1, 7], [2, 2], [2, 7]]
    # as vLLM, a word's first tokens are looked for in the output only, never in the prompt
    fresh = TokenHistory(SamplingParams(), [1, 5], 2, frozenset(), bad_words=[(5, 9)])
    assert not (adjusted(logits[:1], [fresh]) == -INF).any()


def test_min_tokens_holds_back_the_stop_tokens_until_the_output_is_long_enough():
    logits = torch.zeros(4, 6)
    params = SamplingParams(min_tokens=3)
    window = TokenHistory(params, [0, 1], num_prompt_tokens=1, stop_ids=frozenset({2, 4}), drafts=[5, 5, 5])
    out = adjusted(logits, [window])
    held = out[:, [2, 4]] == -INF
    assert held.tolist() == [[True, True], [True, True], [False, False], [False, False]]  # 1, 2, then 3 tokens out


def test_a_window_row_is_adjusted_as_the_same_row_alone_after_its_drafts():
    """Verification adjusts row j after the drafts before it, exactly as AR adjusts that row when
    those drafts are its output: the same numbers, bit for bit, whatever shares the call."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=-0.3, min_tokens=4, logit_bias={9: 1.5, 60: -3.0},
                            allowed_token_ids=list(range(56)))
    prompt, output, drafts = [3, 7, 7, 11], [7, 2, 40], [2, 2, 9, 40, 51]
    words = [(2, 9), (9, 40, 13), (17,)]
    logits = torch.randn(len(drafts) + 1, 64, generator=gen) * 3
    other = TokenHistory(SamplingParams(repetition_penalty=1.1), [1, 4], 1, frozenset({0}))
    window = adjusted(torch.cat([torch.randn(1, 64, generator=gen), logits]),
                      [other, TokenHistory(params, prompt + output, len(prompt), frozenset({2}), drafts, words)])[1:]
    for j in range(len(drafts) + 1):
        history = TokenHistory(params, prompt + output + drafts[:j], len(prompt), frozenset({2}), bad_words=words)
        assert torch.equal(window[j], adjusted(logits[j : j + 1], [history])[0]), j
    assert (window == -INF).any() and (window[0] != logits[0]).any()


@pytest.mark.skipif(native_kernels() is None, reason="needs the native CPU kernels")
def test_the_native_adjustments_of_decode_steps_are_adjust_logits_bit_for_bit():
    """What several decode steps in one call apply natively (``step_adjustments`` packed for the
    kernels' ``LogitAdjustments``): every setting alone and together, greedy and sampled rows, rows
    that adjust nothing, logits with NaN, +-inf, +-0 and ties, stop ids past the vocabulary, a
    penalty that is -0 in float32 (on) and one of -0 (off); then
    the steps' histories growing by a token (min_tokens counting down, a new and a repeated token)
    as one step a call sees them (the decode-steps tests check ``advance`` through the engine)."""
    gen = torch.Generator().manual_seed(3)
    vocab = 300
    kinds = [dict(repetition_penalty=1.3), dict(repetition_penalty=0.8, temperature=0.9),
             dict(frequency_penalty=0.45, presence_penalty=-0.3, temperature=1.1), dict(presence_penalty=0.7),
             dict(frequency_penalty=-1.5), dict(min_p=0.2, temperature=0.7), dict(min_p=0.9, temperature=0.0),
             dict(logit_bias={3: 2.5, 17: -100.0, 299: 0.125}), dict(min_tokens=6), dict(temperature=0.6),
             dict(temperature=1.3, top_k=9, min_p=0.05, repetition_penalty=1.15, frequency_penalty=0.2,
                  presence_penalty=0.1, logit_bias={8: 1.5, 60: -3.0}, min_tokens=7),
             dict(frequency_penalty=-1e-46), dict(presence_penalty=-0.0, temperature=0.9)]  # -0 in float32; off
    histories = []
    for i, kind in enumerate(kinds * 3):
        prompt = torch.randint(0, vocab, (5 + i,), generator=gen).tolist()
        output = torch.randint(0, 40, (i % 9,), generator=gen).tolist()  # repeats among them
        histories.append(TokenHistory(SamplingParams(**kind), prompt + output, len(prompt), frozenset({2, 5, 4000})))
    logits = torch.randn(len(histories), vocab, generator=gen) * 4
    logits[0, :8] = torch.tensor([INF, -INF, math.nan, 0.0, -0.0, 5.0, 5.0, -1e-30])
    logits[5, 11], logits[16, 0], logits[27, 40] = math.nan, math.nan, -INF  # NaN in min_p rows: all -inf
    for step in range(3):
        logits[:, 7] = -0.0  # a -0 logit of an output token (from the second step): a tiny negative penalty makes it +0
        expected = adjusted(logits, histories)
        got = logits.clone()
        native_kernels().adjust_logit_rows(got, list(step_adjustments(histories)))
        assert torch.equal(got.isnan(), expected.isnan()), step
        assert torch.equal(got.nan_to_num(), expected.nan_to_num()), step
        assert torch.equal(got.signbit(), expected.signbit()), step
        assert (expected != logits).any(dim=1).sum() >= 20  # most rows changed (not the plain ones)
        token = 7 + step % 2  # a new token, then the same one again
        histories = [TokenHistory(h.params, [*h.token_ids, token], h.num_prompt_tokens, h.stop_ids) for h in histories]
        logits = torch.randn(len(histories), vocab, generator=gen) * 4
    with pytest.raises(ValueError, match="one step a call"):
        step_adjustments([TokenHistory(SamplingParams(allowed_token_ids=[1, 2]), [0], 1, frozenset())])


def test_token_ids_past_the_vocabulary_are_refused_by_name(draft_pair):
    llm = LLM(draft_pair["target"])
    for field, value in (("logit_bias", {8: 1.0}), ("allowed_token_ids", (1, 9))):
        with pytest.raises(SpecforkError, match=f"{field} names token ids \\[{8 if field == 'logit_bias' else 9}\\] "
                                                r"outside the vocabulary \[0, 8\)") as error:
            llm.generate([PROMPT], SamplingParams(**{field: value}))
        assert error.value.param == field


def test_allowed_ids_that_leave_nothing_to_generate_are_refused(draft_pair):
    llm = LLM(draft_pair["target"])
    with pytest.raises(SpecforkError, match="allowed_token_ids holds only stop tokens, which min_tokens holds back") as e:
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[EOS, 3], stop_token_ids=[3], min_tokens=2))
    assert e.value.param == "allowed_token_ids"
    # with EOS ignored it is no stop token, and without min_tokens a stop token may come first
    for params in (SamplingParams(allowed_token_ids=[EOS], min_tokens=2, ignore_eos=True, max_tokens=3),
                   SamplingParams(allowed_token_ids=[EOS], max_tokens=3)):
        assert set(llm.generate([PROMPT], params)[0].token_ids) == {EOS}


def test_bad_words_need_a_tokenizer(draft_pair):
    with pytest.raises(SpecforkError, match="bad_words needs the model's tokenizer") as error:
        LLM(draft_pair["target"]).generate([PROMPT], SamplingParams(bad_words=["x"]))
    assert error.value.param == "bad_words"


def test_histories_must_cover_the_rows():
    with pytest.raises(ValueError, match="3 rows of logits for histories of 2 rows"):
        adjusted(torch.zeros(3, 4), [TokenHistory(SamplingParams(min_tokens=1), [0], 1, frozenset(), [1])])


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be finite and > 0"),
    ("presence_penalty", -2.5, r"presence_penalty must be in \[-2, 2\]"),
    ("frequency_penalty", math.nan, r"frequency_penalty must be in \[-2, 2\]"),
    ("min_tokens", 17, r"min_tokens must be an integer in \[0, 16\] \(at most the tokens the request may generate\)"),
    ("min_tokens", 1.0, "min_tokens must be an integer"),
    ("logit_bias", {5: 101}, r"logit_bias must map token ids \(integers >= 0\) to biases in \[-100, 100\]"),
    ("logit_bias", {"x": 1}, "logit_bias must map token ids"),
    ("allowed_token_ids", [3, -1], "allowed_token_ids must be a list of integers >= 0"),
    ("allowed_token_ids", [], "allowed_token_ids must name at least one token"),
    ("logit_bias", {"\u00b2": 1}, r"logit_bias must map .* it holds \('\u00b2', 1\)"),  # a digit int() refuses
    ("logit_bias", {"\u0663": 1}, "logit_bias must map"),  # an Arabic-Indic 3: ids are written in ASCII
    ("logit_bias", {str(i): 200 for i in range(5000)}, r"it holds \('0', 200\)$"),  # the pair, not the dict
    ("bad_words", [" "], "bad_words must be a non-empty string"),
    ("bad_words", [f"w{i}" for i in range(129)], "bad_words holds 129 words; at most 128"),
])
def test_bad_settings_are_clear_errors(field, value, message):
    with pytest.raises(SpecforkError, match=message) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint("llama-gqa-tied", tmp_path_factory.mktemp("adjust"), seed=31)


def test_ar_with_a_repetition_penalty_and_min_tokens_is_transformers_greedy_with_its_processors(tiny):
    from transformers import AutoModelForCausalLM

    prompt = [1, 17, 40, 17, 40, 17, 40, 99]
    llm = LLM(str(tiny.path), deterministic=True)
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0].token_ids
    stop = plain[1]  # a stop token the plain output meets at once
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.8, min_tokens=6, stop_token_ids=(stop,))
    ours = llm.generate([prompt], params)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(tiny.path), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, repetition_penalty=1.8,
                      min_new_tokens=6, eos_token_id=[2, stop], pad_token_id=0, output_scores=True,
                      return_dict_in_generate=True)
    theirs = out.sequences[0, len(prompt):].tolist()
    assert_greedy_match(ours, theirs, [s[0] for s in out.scores])
    assert len(ours) >= 6 and ours != plain[: len(ours)]


@pytest.fixture(scope="module")
def adjusted_requests():
    """Four requests on the 8-token target, each adjusting its logits another way (EOS counts)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.9, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, stop_token_ids=(0,)),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=0.8, presence_penalty=-0.5, ignore_eos=True,
                       logit_bias={3: 2.0}),
        SamplingParams(temperature=0.0, max_tokens=24, allowed_token_ids=(0, 2, 4, 6), ignore_eos=True),
    ]


PROMPTS = [PROMPT, [2, 4], [6, 1, 1, 0, 3], [5], [1, 1, 7]]


@pytest.fixture(scope="module")
def ar_adjusted(draft_pair, adjusted_requests):
    llm = LLM(draft_pair["target"], deterministic=True)
    outs = [o.token_ids for o in llm.generate(PROMPTS, adjusted_requests)]
    plain = [o.token_ids for o in llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                        stop_token_ids=p.stop_token_ids)
                                                         for p in adjusted_requests])]
    for adjusted, unadjusted in zip(outs, plain, strict=True):  # each request's adjustment changes its output
        assert adjusted != unadjusted
    assert EOS not in outs[2][:12] and 0 not in outs[2][:12]
    assert set(outs[4]) <= {0, 2, 4, 6}
    return outs


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_sd_with_adjusted_logits_equals_ar(draft_pair, adjusted_requests, ar_adjusted, k):
    llm = LLM(draft_pair["target"], mode="sd", draft=draft_pair["draft"], k=k, deterministic=True)
    outs = llm.generate(PROMPTS, adjusted_requests)
    assert [o.token_ids for o in outs] == ar_adjusted
    assert 0 < sum(o.metrics["draft_tokens_accepted"] for o in outs) < sum(o.metrics["draft_tokens_proposed"] for o in outs)


class OracleProposer(StatelessProposer):
    """Proposes each sequence's AR continuation, the last token of every other proposal wrong: long
    accepted runs whose later rows are adjusted after the drafts before them, and rejections."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.rounds = 0

    def propose(self, seqs, num_tokens):
        tokens = []
        for seq, n in zip(seqs, num_tokens, strict=True):
            done = seq.num_output_tokens
            props = list(self.continuations[tuple(seq.prompt_token_ids)][done : done + n])
            self.rounds += 1
            if props and self.rounds % 2:
                props[-1] = (props[-1] + 1) % 8
            tokens.append(props)
        return Proposal(tokens, None)


def test_greedy_sd_with_drafts_that_follow_the_adjusted_output_equals_ar(draft_pair, adjusted_requests, ar_adjusted):
    llm = LLM(draft_pair["target"], mode="sd", drafter="ngram", k=5, deterministic=True)
    llm.engine.step_strategy.proposer = OracleProposer({tuple(p): o for p, o in zip(PROMPTS, ar_adjusted, strict=True)})
    outs = llm.generate(PROMPTS, adjusted_requests)
    assert [o.token_ids for o in outs] == ar_adjusted
    rounds = sum(o.metrics["spec_rounds"] for o in outs)
    assert sum(len(o.token_ids) for o in outs) > 3 * rounds  # mostly long accepted runs
    assert sum(o.metrics["draft_tokens_accepted"] for o in outs) < sum(o.metrics["draft_tokens_proposed"] for o in outs)


@pytest.mark.dist
def test_greedy_ssd_with_adjusted_logits_equals_ar(draft_pair, adjusted_requests, ar_adjusted):
    with LLM(draft_pair["target"], mode="ssd", draft=draft_pair["draft"], k=3, deterministic=True) as llm:
        outs = llm.generate(PROMPTS, adjusted_requests)
        assert llm.engine.step_strategy.proposer.failure is None
    assert [o.token_ids for o in outs] == ar_adjusted
    assert sum(o.metrics["ssd_cache_hits"] for o in outs) > 0
