"""Text-level behaviour on the embedded SmolLM2 model: stop strings, chat, streaming, and
n-gram speculative decoding on HumanEval prompts (bit-identical to AR in deterministic mode)."""

import pytest
from helpers import humaneval_prompts

from specfork import LLM, SamplingParams, SpecforkError
from specfork.speculative.proposer import Proposal, StatelessProposer


@pytest.fixture(scope="module")
def ar_det():
    return LLM(deterministic=True)


def test_stop_string_cuts_text_and_finishes(ar_det):
    free = ar_det.chat([{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
                       SamplingParams(temperature=0.0, max_tokens=60))[0]
    assert "5" in free.text
    stop = ar_det.chat([{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
                       SamplingParams(temperature=0.0, max_tokens=60, stop=("5",)))[0]
    assert stop.finish_reason == "stop"
    assert "5" not in stop.text and free.text.startswith(stop.text)
    assert len(stop.token_ids) < len(free.token_ids)
    kept = ar_det.chat([{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
                       SamplingParams(temperature=0.0, max_tokens=60, stop=("5",), include_stop_str_in_output=True))[0]
    assert kept.text == stop.text + "5" and kept.token_ids == stop.token_ids


def test_min_tokens_passes_stop_strings_and_eos_in_its_first_tokens(ar_det):
    """As vLLM: within the first min_tokens tokens EOS is held back and a stop string does not
    count; one that ends after them does (even if it began within them)."""
    count = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    free = ar_det.chat(count, SamplingParams(temperature=0.0, max_tokens=60))[0]
    decode = ar_det.engine.tokenizer.decode
    early = decode(free.token_ids[:7])  # "1. 1\n2." as this model counts
    assert early.count(".") >= 2  # stop strings it passes
    later = free.text.index(".", len(early))
    out = ar_det.chat(count, SamplingParams(temperature=0.0, max_tokens=60, stop=(".",), min_tokens=7))[0]
    assert out.finish_reason == "stop" and out.text == free.text[:later]
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) > 7
    # a stop string that began within them and ends after them counts
    across = ar_det.chat(count, SamplingParams(temperature=0.0, max_tokens=60, stop=(". 2",), min_tokens=7))[0]
    assert across.finish_reason == "stop" and across.text == free.text[: free.text.index(". 2")]

    question = [{"role": "user", "content": "What is the capital of France?"}]
    short = ar_det.chat(question, SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert short.token_ids[-1] == 2
    longer = ar_det.chat(question, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=len(short.token_ids) + 4))[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 4 and 2 not in longer.token_ids[: len(short.token_ids) + 4]


def test_min_tokens_ending_inside_a_character_leaves_that_character_to_the_stop_strings(ar_det):
    """Each emoji here is three tokens. As in vLLM, the first min_tokens tokens own only the
    characters they complete: with min_tokens 1 or 2 the first emoji, completed by token 3, may
    already be a stop string."""
    prompt = "😀" * 16
    free = ar_det.generate(prompt, SamplingParams(temperature=0.0, max_tokens=9))[0]
    assert free.text.startswith("😀😀") and len(free.token_ids[:3]) == 3
    assert ar_det.engine.tokenizer.decode(free.token_ids[:1]) != "😀"  # a token begins the character
    for min_tokens, cut in ((0, 3), (1, 3), (2, 3), (3, 6)):
        out = ar_det.generate(prompt, SamplingParams(temperature=0.0, max_tokens=9, stop=("😀",), min_tokens=min_tokens))[0]
        assert len(out.token_ids) == cut and out.text == "😀" * (cut // 3 - 1), (min_tokens, out.token_ids, out.text)


def test_bad_words_are_never_completed_and_sd_still_equals_ar(ar_det):
    """A bad word's last token is held back wherever its first tokens end the text so far (vLLM's
    rule, each word alone and after a space); greedy SD with the shipped head verifies each
    window row after the drafts before it, so it equals AR."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    plain = ar_det.chat(question, SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert "Paris" in plain.text and "capital of" in plain.text
    params = SamplingParams(temperature=0.0, max_tokens=30, bad_words=["Paris", "capital of"])
    out = ar_det.chat(question, params)[0]
    assert "Paris" not in out.text and "capital of" not in out.text, out.text
    assert ar_det.engine.bad_word_ids(params) == ((38634,), (7042,), (29721, 282), (3575, 282))
    with pytest.raises(SpecforkError, match="every token of allowed_token_ids ends a bad word"):
        ar_det.generate("x", SamplingParams(allowed_token_ids=[38634, 7042], bad_words=["Paris"]))
    one = ar_det.engine.tokenizer.encode_fragment("1")
    assert ar_det.engine.tokenizer.encode_fragment("11") == one * 2
    with pytest.raises(SpecforkError, match="every token of allowed_token_ids ends a bad word"):  # after a "1"
        ar_det.generate("x", SamplingParams(allowed_token_ids=one, bad_words=["11"]))
    with LLM(mode="sd", k=4, deterministic=True) as sd:
        assert sd.chat(question, params)[0].token_ids == out.token_ids
        # drafts that replay the unconstrained reply ("The capital of France is Paris."): the row
        # after the draft "capital" must hold "of" back
        sd.engine.step_strategy.proposer = Replay(plain.token_ids)
        replayed = sd.chat(question, params)[0]
        assert replayed.token_ids == out.token_ids and replayed.metrics["draft_tokens_accepted"] >= 1


class Replay(StatelessProposer):
    """Proposes the tokens of a given output at the sequence's position, whatever it holds."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, seqs, num_tokens):
        return Proposal([self.tokens[s.num_output_tokens : s.num_output_tokens + n] for s, n in
                         zip(seqs, num_tokens, strict=True)], None)


def test_chat_reply_is_sensible(ar_det):
    out = ar_det.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.text and out.finish_reason == "stop" and out.token_ids[-1] == 2



def test_special_tokens_and_the_stopping_token_in_the_text_as_vllm(ar_det):
    """The token that ended a reply (EOS, a stop id) stays out of the text unless
    include_stop_str_in_output; skip_special_tokens=False keeps other special tokens' text."""
    question = [{"role": "user", "content": "What is the capital of France?"}]

    def reply(**options):
        return ar_det.chat(question, SamplingParams(temperature=0.0, max_tokens=24, **options))[0]

    out = reply()
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2
    assert reply(skip_special_tokens=False).text == out.text
    assert reply(skip_special_tokens=False, include_stop_str_in_output=True).text == out.text + "<|im_end|>"
    going_on = reply(ignore_eos=True, skip_special_tokens=False)
    assert going_on.text.startswith(out.text + "<|im_end|>") and "<|im_start|>" in going_on.text
    assert "<|im_" not in reply(ignore_eos=True).text
    cut = out.token_ids.index(out.token_ids[3])  # its first occurrence ends the reply
    by_id = reply(stop_token_ids=(out.token_ids[3],))
    assert by_id.token_ids == out.token_ids[: cut + 1]
    assert by_id.text == ar_det.engine.tokenizer.decode(out.token_ids[:cut])


def test_stream_yields_the_final_text(ar_det):
    ids = ar_det.encode_chat([{"role": "user", "content": "Name three colors."}])
    params = SamplingParams(temperature=0.0, max_tokens=40)
    pieces = list(ar_det.stream(ids, params))
    assert len(pieces) > 3 and "".join(pieces) == ar_det.last_output.text
    assert ar_det.generate([ids], params)[0].text == ar_det.last_output.text


def test_streams_consumed_in_turn_each_yield_their_whole_text(ar_det):
    """One stream's step can finish another's sequence; what that one had not yet yielded (its
    last piece) was then never yielded."""
    import itertools

    prompts = ["Write a Python function that checks whether a number is prime.", "def factorial(n):"]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    expected = [ar_det.generate([p], sp)[0].text for p, sp in zip(prompts, params, strict=True)]
    got = [[], []]
    for pieces in itertools.zip_longest(*(ar_det.stream(p, sp) for p, sp in zip(prompts, params, strict=True))):
        for mine, piece in zip(got, pieces, strict=True):
            mine.append(piece or "")
    assert ["".join(g) for g in got] == expected
    assert ar_det.engine.block_manager.num_used_blocks == 0


def test_ngram_sd_equals_ar_on_humaneval(ar_det):
    prompts = humaneval_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    ar = [o.token_ids for o in ar_det.generate(prompts, params)]
    sd = LLM(mode="sd", drafter="ngram", k=5, deterministic=True)
    outs = sd.generate(prompts, params)
    assert [o.token_ids for o in outs] == ar
    assert sum(o.metrics["draft_tokens_accepted"] for o in outs) > 10


SPLIT_CHARACTERS = "Trees 🌳🌳 and 日本語 ∑ x²"


def test_token_bytes_join_into_the_text_where_tokens_split_characters(ar_det):
    tok = ar_det.engine.tokenizer
    ids = tok.encode(SPLIT_CHARACTERS)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # decoding token by token loses bytes here
    assert b"".join(tok.token_bytes(i) for i in ids) == SPLIT_CHARACTERS.encode("utf-8")


def test_completion_text_offsets_are_each_tokens_character_in_the_text(ar_det):
    from specfork.serve.responses import TextCursor, TokenNames, completion_logprobs

    ids = ar_det.engine.tokenizer.encode(SPLIT_CHARACTERS)
    names = TokenNames(ar_det.engine.tokenizer)
    utf8 = SPLIT_CHARACTERS.encode("utf-8")
    starts = [sum(len(names.bytes_of(t)) for t in ids[:i]) for i in range(len(ids))]  # each token's first byte
    # the character holding that byte: the characters wholly before it
    expected = [len(utf8[:b].decode("utf-8", errors="ignore")) for b in starts]
    assert completion_logprobs(names, [(None, t) for t in ids], TextCursor())["text_offset"] == expected
    # streamed in pieces, one cursor going on from chunk to chunk: the same offsets
    cursor, pieces = TextCursor(), []
    for chunk in (ids[:3], ids[3:4], ids[4:]):
        pieces += completion_logprobs(names, [(None, t) for t in chunk], cursor)["text_offset"]
    assert pieces == expected
    assert max(expected) < len(SPLIT_CHARACTERS) and expected != list(range(len(ids)))


def test_chat_logprob_bytes_join_into_the_text(ar_det):
    from specfork.outputs import TokenLogprob
    from specfork.serve.responses import TokenNames, chat_logprobs

    ids = ar_det.engine.tokenizer.encode(SPLIT_CHARACTERS)
    content = chat_logprobs(TokenNames(ar_det.engine.tokenizer), [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids])
    assert bytes(b for item in content["content"] for b in item["bytes"]) == SPLIT_CHARACTERS.encode("utf-8")
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in content["content"])
