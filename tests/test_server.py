"""The OpenAI-compatible server, driven over real HTTP by the official ``openai`` client.

Servers run as subprocesses (``python -m specfork.cli serve --port 0``) exactly as users start
them. The embedded model serves greedy requests in deterministic mode, so its answers must equal
offline ``LLM.generate`` token for token whatever else shares the batch.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time

import pytest
from servers import running_server, running_servers

from specfork import LLM, SamplingParams
from specfork.sampling_params import StructuredOutputs

pytestmark = pytest.mark.dist
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef normalize(x):",
           "Once upon a time", "SELECT name FROM users WHERE"]


BODY_LIMIT = 8_000_000


@pytest.fixture(scope="module")
def server():
    with running_server("--deterministic", "--max-num-seqs", "32", "--max-model-len", "1024",
                        "--max-request-bytes", str(BODY_LIMIT)) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    return LLM(deterministic=True, max_model_len=1024)


def test_models_and_health(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert server.get("/health") == (200, '{"status":"ok"}')


def test_completions_equal_offline_generation(server, offline):
    client = server.client()
    for prompt in PROMPTS[:3]:
        expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0]
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == expected.text
        assert got.choices[0].finish_reason == expected.finish_reason
        assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert got.usage.completion_tokens == len(expected.token_ids)
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_chat_equals_offline_chat(server, offline):
    client = server.client()
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name three fruits."}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=32))[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, offline):
    """vLLM's stream option: each chunk carries the tokens generated up to it; the last usage chunk
    is the whole request's. Other stream options are refused by name; OpenAI's
    include_obfuscation is accepted (no padding is sent)."""
    client = server.client()
    prompt = "Count to ten:"
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "stream_options": options}))
    so_far = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == len(offline.encode(prompt)) for c in chunks)
    assert so_far == sorted(so_far) and so_far[-1] == len(expected.token_ids) and so_far[0] < so_far[-1]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    status, reply = server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stream": True,
                                                               "stream_options": {"include_usage": True, "extra": 1}}))
    assert status == 400 and "stream_options.extra" in reply["error"]["message"], reply
    # as vLLM: each chunk carries its own choice's counts, and its own prompt's; a null option is its default
    prompts = ["Hi", prompt]
    options = {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": None}
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "stream_options": options}))
    by_choice = {}
    for c in chunks[:-1]:
        index = c.choices[0].index
        assert c.usage.prompt_tokens == len(offline.encode(prompts[index // 2])), c
        by_choice.setdefault(index, []).append(c.usage.completion_tokens)
    assert sorted(by_choice) == [0, 1, 2, 3] and all(v == sorted(v) and v[-1] == 6 for v in by_choice.values())
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_stop_strings_and_seeded_sampling(server, offline):
    client = server.client()
    expected = offline.generate("def add(a, b):", SamplingParams(temperature=0.0, max_tokens=40, stop=("return",)))[0]
    got = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=40, temperature=0, stop="return")
    assert got.choices[0].text == expected.text and "return" not in got.choices[0].text
    sampled = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9,
                                         top_p=0.9, seed=7).choices[0].text for _ in range(2)]
    offline_sample = offline.generate("Once upon a time", SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=7))
    assert sampled[0] == sampled[1] == offline_sample[0].text


def test_32_concurrent_streams_complete_with_correct_outputs(server, offline):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.text for o in offline.generate(prompts, params)]

    async def run() -> list[str]:
        client = server.async_client()

        async def one(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(run()) == expected
    assert server.metric("specfork_kv_cache_blocks_used") == 0


def test_a_cancelled_stream_frees_its_sequence_and_blocks(server):
    client = server.client()
    stream = client.completions.create(model=MODEL, prompt="Write a long story.", max_tokens=900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received >= 3:
            break
    assert server.metric("specfork_kv_cache_blocks_used") > 0
    disconnects = server.metric("specfork_client_disconnects_total")
    aborted = server.metric("specfork_requests_finished_total", 'finish_reason="abort"')
    stream.close()  # the client goes away mid-stream
    _assert_cancelled_once(server, disconnects, aborted)


def _assert_cancelled_once(server, disconnects: float, aborted: float) -> None:
    """Once the server has settled: the request's sequence and KV blocks are freed, and it was
    counted as one disconnect and one request finished with reason "abort", never as an error
    (a dashboard alerting on errors must not fire on clients going away)."""
    deadline = time.time() + 30
    while time.time() < deadline and (server.metric("specfork_kv_cache_blocks_used") > 0
                                      or server.metric("specfork_num_requests_running") > 0):
        time.sleep(0.2)
    assert server.metric("specfork_kv_cache_blocks_used") == 0
    assert server.metric("specfork_num_requests_running") == 0
    assert server.metric("specfork_client_disconnects_total") == disconnects + 1
    assert server.metric("specfork_requests_finished_total", 'finish_reason="abort"') == aborted + 1
    assert 'specfork_request_errors_total{status="499"}' not in server.get("/metrics")[1]


def test_a_client_that_stops_waiting_for_a_whole_reply_frees_its_sequence(server):
    """A non-streaming request whose client gives up while tokens are still being produced (each
    step sends the request an event, which once kept the disconnect check from ever running: the
    request ran to its last token, and the openai client's retries ran two more)."""
    disconnects = server.metric("specfork_client_disconnects_total")
    aborted = server.metric("specfork_requests_finished_total", 'finish_reason="abort"')
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=1.5, max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL, prompt="Write a long story.", max_tokens=900, temperature=0,
                                  extra_body={"ignore_eos": True})
    _assert_cancelled_once(server, disconnects, aborted)


BAD_REQUESTS = [
    ("/v1/completions", "{not json", "not valid JSON"),
    ("/v1/completions", "[1, 2]", "JSON object"),
    ("/v1/completions", json.dumps({"prompt": "hi"}), "'model' is required"),
    ("/v1/completions", json.dumps({"model": MODEL}), "'prompt' is required"),
    ("/v1/completions", json.dumps({"model": "gpt-9", "prompt": "hi"}), "does not exist"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}), "temperature"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": 5}), "temperature"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "top_p": 0}), "top_p"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}), "max_tokens: 0 returns nothing"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 2}),
     "min_tokens (2) cannot exceed"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 0}), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 0}), "n: Input should be greater"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 129}), "n: Input should be less"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}), "stream"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 21}), "logprobs"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "best_of": 3}), "'best_of' other than n"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "best_of": 1, "n": 2}), "'best_of' other than n"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "top_logprobs": 2}), "top_logprobs: needs logprobs: true"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "min_p": 1.5}), "min_p must be in [0, 1]"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}),
     "repetition_penalty must be finite and > 0"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}),
     "min_tokens must be an integer in [0, 4] (at most the tokens the request may generate)"),
    # fields that were accepted and ignored: vLLM's sampling extensions, tools, unknown names
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "length_penalty": 2.0}),
     "'length_penalty' is not supported"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "use_beam_search": 0}),
     "'use_beam_search' is not supported"),  # 0 is not False
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "guided_grammar": "root ::= 'a'"}),
     "'guided_grammar' is not supported"),
    # structured outputs: one field at a time, each complete, each compiling
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_object"},
                                    "guided_regex": "a+"}), "give one of response_format, guided_regex"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema"}}),
     "json_schema is given with type 'json_schema', and only then"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "guided_json": {"type": "frob"}}),
     "the structured output does not compile"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "guided_choice": []}),
     "choice must be a non-empty list"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "guided_regex": "a+", "ignore_eos": True}),
     "ignore_eos cannot be combined with structured outputs"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "guided_json": "[" * 100_000}),
     "the JSON schema is not JSON"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "guided_regex": "a+",
                                    "guided_whitespace_pattern": " "}), "'guided_whitespace_pattern' is not supported"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_completion_tokens": 3}),
     "'max_completion_tokens' is not a parameter of this endpoint (it spells this 'max_tokens')"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temprature": 0}),
     "'temprature' is not a parameter of this endpoint"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "tool_choice": "required"}), "'tool_choice' is not supported"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "echo": True}), "'echo' is not supported"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}),
     "content parts of type 'image_url' are not supported"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "tool", "content": "4", "tool_call_id": "1"}]}), "tool calls and tool results are not supported"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x", "mood": 1}]}),
     "messages.0.mood: unknown field"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                         "continue_final_message": True}),
     "continue_final_message: needs add_generation_prompt: false"),
    # the seed overflow that used to kill the engine loop (500, then 503 for everyone)
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4, "seed": 2**64}), "seed"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4, "seed": -(2**63) - 1}), "seed"),
    # lone surrogates: 500 before (the tokenizer cannot encode them)
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL,
     "lone surrogate"),
    ("/v1/completions", '{"model": "%s", "prompt": "a\\udfffb"}' % MODEL, "lone surrogate"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "does not exist"),
    # JSON nested 100k levels deep: RecursionError, a 500 before
    ("/v1/completions", '{"model": "%s", "prompt": %s}' % (MODEL, "[" * 100_000 + "]" * 100_000), "nested too deeply"),
    ("/v1/chat/completions", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ""}), "empty"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}]}), "empty"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [999999]}), "outside the vocabulary"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 1100}), "context"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5000}), "5000"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 5000, "stream": True}), "5000"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}), "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}), "role"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hello"}), "messages"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}),
     "stream_options: only allowed with stream: true"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": None}), "prompt"),  # a required field stays required
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["a"] * 65, "n": 2}), "65 prompts x n = 2 makes 130"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["hi", "word " * 1100]}), "prompt.1: "),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ["hi", "word " * 1000], "max_tokens": 100}),
     "prompt.1: "),  # the engine's own length rule, for one prompt of a batch
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "add_special_tokens": False}),
     "'add_special_tokens' is not supported"),
]


@pytest.mark.parametrize("path,body,message", BAD_REQUESTS, ids=[f"{i}-{m}" for i, (_, _, m) in enumerate(BAD_REQUESTS)])
def test_bad_input_is_a_400_naming_the_problem(server, path, body, message):
    status, reply = server.post(path, body)
    assert status == 400, reply
    assert message in reply["error"]["message"], reply
    if message == "5000":  # the engine's rule names both numbers
        assert "1024" in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    # and the server still answers
    assert server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}))[0] == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "word " * 1100}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "length_penalty": 2.0}, "length_penalty"),
    ("/v1/completions", {"prompt": "hi", "temprature": 0}, "temprature"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"49152": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"hello": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [1, 60000]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "bad_words": [""]}, "bad_words"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "(ab"}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, "response_format"),
], ids=["completions-max_tokens", "chat-max_tokens", "chat-max_completion_tokens", "prompt", "top_p",
        "stream_options", "top_logprobs", "out-of-range", "unsupported", "unknown", "bias-past-vocab", "bias-key",
        "allowed-past-vocab", "allowed-empty", "bad-word-empty", "bad-regex", "bad-schema"])
def test_a_refused_request_names_its_parameter_as_the_request_did(server, path, body, param):
    """The engine's own rules (prompt plus max_tokens within the context) are checked when it
    admits the request; the error body's param names the field the request used."""
    status, reply = server.post(path, json.dumps({"model": MODEL, **body}))
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


def test_the_openai_client_sees_bad_requests_as_bad_request_errors(server):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        server.client().completions.create(model="nope", prompt="hi", max_tokens=2)


def test_metrics_are_prometheus_text(server):
    status, text = server.get("/metrics")
    assert status == 200
    for name in ("specfork_requests_finished_total", "specfork_generation_tokens_total",
                 "specfork_time_to_first_token_seconds_bucket", "specfork_time_per_output_token_seconds_count",
                 "specfork_spec_acceptance_rate", "specfork_spec_rounds_without_drafts_total",
                 "specfork_ssd_cache_hit_rate", "specfork_num_requests_waiting",
                 "specfork_kv_cache_usage"):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? \S+$", text, re.M), name
    assert server.metric("specfork_generation_tokens_total") > 0


def test_optional_fields_sent_as_null_take_their_defaults(server):
    """The OpenAI API's optional fields are nullable, and clients send null for them."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "echo": None, "logprobs": None,
             "stop": None, "seed": None, "stream_options": None, "top_k": None, "ignore_eos": None}
    greedy = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    status, reply = server.post("/v1/completions", json.dumps({**greedy, **nulls, "temperature": 0}))
    assert status == 200, reply
    assert reply["choices"][0]["text"] == server.post("/v1/completions", json.dumps(greedy))[1]["choices"][0]["text"]
    assert len(reply["choices"]) == 1 and reply["choices"][0]["logprobs"] is None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": None,
            "top_logprobs": None, "max_completion_tokens": None, "temperature": None, "n": None}
    status, reply = server.post("/v1/chat/completions", json.dumps(chat))
    assert status == 200 and reply["choices"][0]["logprobs"] is None, reply


def test_penalties_min_p_and_min_tokens_reach_the_engine(server, offline):
    """OpenAI's presence and frequency penalties and logit bias (the client's own arguments) and
    vLLM's repetition_penalty, min_p and min_tokens give what the Python API gives."""
    client = server.client()
    prompt = "List the days of the week:"
    monday = offline.engine.tokenizer.encode(" Monday")[0]
    settings = {"presence_penalty": 0.8, "frequency_penalty": 1.2, "logit_bias": {str(monday): -100}}
    extra = {"repetition_penalty": 1.3, "min_p": 0.2, "min_tokens": 20, "bad_words": ["Tuesday"]}
    expected = offline.generate(prompt, SamplingParams(temperature=0.7, max_tokens=24, seed=5, **settings, **extra))[0]
    assert monday not in expected.token_ids and "Tuesday" not in expected.text
    plain = offline.generate(prompt, SamplingParams(temperature=0.7, max_tokens=24, seed=5))[0]
    assert expected.text != plain.text
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.7, seed=5, stream=stream,
                                        **settings, extra_body=extra)
        text = "".join(c.choices[0].text for c in got if c.choices) if stream else got.choices[0].text
        assert text == expected.text, stream


def test_vllm_extensions_the_engine_has_are_honoured_and_neutral_values_accepted(server, offline):
    """stop_token_ids ends a choice at that token, include_stop_str_in_output keeps the stop string,
    skip_special_tokens false keeps special tokens' text, top_k -1 means off (vLLM's spelling), and the
    neutral values of fields specfork does not implement, or the caller's bookkeeping, change
    nothing."""
    client = server.client()
    prompt, greedy = "The capital of France is", {"max_tokens": 12, "temperature": 0}
    plain = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))[0]
    stop_at = plain.token_ids[3]
    got = client.completions.create(model=MODEL, prompt=prompt, **greedy,
                                    extra_body={"stop_token_ids": [stop_at], "return_token_ids": True})
    ids = got.choices[0].model_extra["token_ids"]
    assert ids == plain.token_ids[: plain.token_ids.index(stop_at) + 1], (ids, plain.token_ids)
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == offline.engine.tokenizer.decode(ids[:-1])  # the stopping token's text left out
    cut = plain.text[6:10]
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=prompt, **greedy, stop=[cut], stream=stream,
                                        extra_body={"include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in got if c.choices) if stream else got.choices[0].text
        assert text == plain.text[: plain.text.index(cut) + len(cut)], (stream, text)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0}
    kept = client.chat.completions.create(**chat, extra_body={"skip_special_tokens": False, "ignore_eos": True})
    skipped = client.chat.completions.create(**chat, extra_body={"ignore_eos": True})
    assert "<|im_end|>" in kept.choices[0].message.content and "<|im_" not in skipped.choices[0].message.content
    harmless = {"prompt_cache_key": "k1", "safety_identifier": "s1", "verbosity": "medium", "add_special_tokens": True,
                "return_tokens_as_token_ids": False, "detokenize": True}
    assert client.completions.create(model=MODEL, prompt=prompt, **greedy, extra_body=harmless).choices[0].text == \
        plain.text
    neutral = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1, "presence_penalty": 0, "logit_bias": {},
               "spaces_between_special_tokens": True, "best_of": 1, "user": "u1",
               "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "guided_json": None}
    got = client.completions.create(model=MODEL, prompt=prompt, **greedy, extra_body=neutral)
    assert got.choices[0].text == plain.text
    batch_of_one = client.completions.create(model=MODEL, prompt=[offline.encode(prompt)], **greedy)
    assert batch_of_one.choices[0].text == plain.text


def test_a_batch_of_prompts_gets_n_choices_each_numbered_across_prompts(server, offline):
    """As vLLM (and OpenAI's legacy completions): choice i * n + j is prompt i's sample j; usage
    counts each prompt once. Texts and token-id lists, streamed or not, with echo."""
    client = server.client()
    prompts = PROMPTS[:3]
    outputs = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    expected = [o.text for o in outputs]
    prompt_tokens = sum(len(offline.encode(p)) for p in prompts)
    for batch in (prompts, [offline.encode(p) for p in prompts]):
        got = client.completions.create(model=MODEL, prompt=batch, n=2, max_tokens=8, temperature=0, echo=True)
        assert [c.index for c in got.choices] == list(range(6))
        assert [c.text for c in got.choices] == [p + e for p, e in zip(prompts, expected, strict=True) for _ in "ab"]
        assert got.usage.prompt_tokens == prompt_tokens
        assert got.usage.completion_tokens == 2 * sum(len(o.token_ids) for o in outputs)
    texts = [""] * 3
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == expected


def test_tokenize_and_detokenize_as_vllm(server, offline):
    """vLLM's /tokenize (a text, or a conversation rendered as chat completions render it) and
    /detokenize (ids back to text, special tokens included)."""
    status, reply = server.post("/tokenize", json.dumps({"model": MODEL, "prompt": PROMPTS[0]}))
    assert status == 200 and reply == {"count": len(offline.encode(PROMPTS[0])), "max_model_len": 1024,
                                       "tokens": offline.encode(PROMPTS[0])}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for options in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        status, reply = server.post("/tokenize", json.dumps({"model": MODEL, "messages": messages, **options}))
        assert status == 200 and reply["tokens"] == offline.encode_chat(messages, **options), options
    status, reply = server.post("/detokenize", json.dumps({"model": MODEL, "tokens": reply["tokens"]}))
    assert status == 200 and reply["prompt"].endswith("<|im_start|>assistant\nHello")
    for path, body, message in [
        ("/tokenize", {"prompt": "Hi", "messages": messages}, "either 'prompt'"),
        ("/tokenize", {"prompt": "Hi", "add_special_tokens": False}, "add_special_tokens"),
        ("/tokenize", {"prompt": "Hi", "mood": 1}, "mood: unknown field"),
        ("/detokenize", {"tokens": [1, 10**9]}, "outside the vocabulary"),
        ("/detokenize", {"model": "other", "tokens": [1]}, "does not exist"),
    ]:
        status, reply = server.post(path, json.dumps({"model": MODEL, **body}))
        assert status == 400 and message in reply["error"]["message"], (path, body, reply)


def test_chat_template_options_and_replies_sent_back_as_the_client_returned_them(server, offline):
    """add_generation_prompt and continue_final_message render the conversation as transformers
    does (the prompt's token count shows which); an assistant message the openai client returned,
    sent back as its model_dump (with refusal, tool_calls, audio ... as null), is history."""
    tokenizer = offline.tokenizer
    client = server.client()
    first = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, temperature=0)
    returned = {**reply.choices[0].message.model_dump(), "reasoning_content": None}  # as vLLM returns it
    history = [*first, returned, {"role": "user", "content": "Again.", "name": "ann"}]
    again = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens == len(tokenizer.apply_chat_template(
        [*first, {"role": "assistant", "content": reply.choices[0].message.content}, history[-1]]))
    opened = [*first, {"role": "assistant", "content": "Hello! I am"}]
    for options, kwargs in [({"add_generation_prompt": False}, {"add_generation_prompt": False}),
                            ({"add_generation_prompt": False, "continue_final_message": True},
                             {"add_generation_prompt": False, "continue_final_message": True})]:
        got = client.chat.completions.create(model=MODEL, messages=opened, max_tokens=4, temperature=0,
                                             extra_body=options)
        assert got.usage.prompt_tokens == len(tokenizer.apply_chat_template(opened, **kwargs)), options
    default = client.chat.completions.create(model=MODEL, messages=opened, max_tokens=4, temperature=0)
    assert default.usage.prompt_tokens == len(tokenizer.apply_chat_template(opened))
    assert len({default.usage.prompt_tokens, got.usage.prompt_tokens}) == 2
    # chat_template_kwargs reach the template (SmolLM2's ignores unknown variables; a reserved one is refused)
    got = client.chat.completions.create(model=MODEL, messages=first, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                     "add_special_tokens": False})
    assert got.usage.prompt_tokens == len(tokenizer.apply_chat_template(first))
    with pytest.raises(openai.BadRequestError, match="set by the request itself"):
        client.chat.completions.create(model=MODEL, messages=first, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_model_card_and_openai_error_bodies_for_unknown_routes(server):
    assert server.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().models.retrieve("gpt-9")
    status, text = server.get("/v1/nope")
    assert status == 404 and json.loads(text)["error"]["message"] == "no such route: GET /v1/nope", text
    status, text = server.get("/v1/completions")
    assert status == 405 and "method not allowed" in json.loads(text)["error"]["message"], text


def _errors_500(server) -> float:
    match = re.search(r'^specfork_request_errors_total\{status="500"\} (\S+)$', server.get("/metrics")[1], re.M)
    return float(match.group(1)) if match else 0.0


def test_a_client_leaving_before_its_body_ends_is_a_disconnect_not_an_error(server):
    errors, left = _errors_500(server), server.metric("specfork_client_disconnects_total")
    seen = len(server.log)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
    deadline = time.monotonic() + 30
    while server.metric("specfork_client_disconnects_total") == left and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("specfork_client_disconnects_total") == left + 1
    assert _errors_500(server) == errors
    assert not any("Traceback" in line for line in server.log[seen:]), server.log[seen:]
    assert server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}))[0] == 200


def test_echoed_text_offsets_follow_characters_split_over_tokens(server, offline):
    prompt = "Trees 🌳🌳 and 日本語"
    status, reply = server.post("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}))
    assert status == 200, reply
    tok = offline.engine.tokenizer
    ids = tok.encode(prompt)
    starts = [sum(len(tok.token_bytes(t)) for t in ids[:i]) for i in range(len(ids))]
    expected = [len(prompt.encode()[:b].decode("utf-8", errors="ignore")) for b in starts]
    assert reply["choices"][0]["logprobs"]["text_offset"][: len(ids)] == expected


def _raw_post(server, headers: str, body_parts=()) -> bytes:
    """Send a request by hand (headers, then body parts) and return the start of the reply."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"{headers}\r\n".encode())
        for part in body_parts:
            sock.sendall(part)
        reply = b""
        try:
            while chunk := sock.recv(4096):  # the server closes the connection after a 413
                reply += chunk
        except ConnectionResetError:  # it did not read what it refused
            if not reply:
                raise
        return reply


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    # Content-Length says too much: refused at once, without a byte of the body sent
    reply = _raw_post(server, f"Content-Length: {BODY_LIMIT + 1}\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and b"--max-request-bytes" in reply, reply
    # no length given (chunked): refused as soon as the limit is passed
    sizes = [1_000_000] * (BODY_LIMIT // 1_000_000) + [BODY_LIMIT % 1_000_000 + 1]  # BODY_LIMIT + 1 bytes
    chunks = [b"%x\r\n%s\r\n" % (n, b"x" * n) for n in sizes]
    reply = _raw_post(server, "Transfer-Encoding: chunked\r\n", chunks)
    assert reply.startswith(b"HTTP/1.1 413"), reply
    assert server.get("/health")[0] == 200


def test_a_large_body_does_not_stall_running_streams(server):
    """A ~4 MB chat body takes seconds to parse, template and tokenize (then fails: too long).
    That work runs off the event loop, so a stream running meanwhile keeps its pace: no gap
    between its chunks comes near the time the big body took (before, it froze for all of it)."""
    content = "hello world, this is a test. " * (4_000_000 // 29)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]})
    stream = server.client().completions.create(model=MODEL, prompt="Write a long story.", max_tokens=1000,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    arrivals = []
    for _ in range(5):
        next(chunks)
        arrivals.append(time.monotonic())
    result = {}

    def big() -> None:
        started = time.monotonic()
        result["reply"] = server.post("/v1/chat/completions", body)
        result["span"] = (started, time.monotonic())

    sender = threading.Thread(target=big)
    sender.start()
    while sender.is_alive():
        next(chunks)
        arrivals.append(time.monotonic())
    stream.close()
    status, reply = result["reply"]
    assert status == 400 and "tokens" in reply["error"]["message"], reply
    start, end = result["span"]
    assert end - start > 1.0, "the body was processed too fast to show anything"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > start and a < end]
    assert gaps and max(gaps) < 0.5 * (end - start), (max(gaps), end - start)


def test_logprobs_match_offline_generation_streamed_or_not(server, offline):
    client = server.client()
    prompt = PROMPTS[1]
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, logprobs=3))[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert "".join(lp.tokens) == got.choices[0].text == expected.text
    assert all(len(top) >= 3 and top[tok] == value for tok, value, top in
               zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=3, stream=True) if c.choices[0].logprobs]
    assert [v for c in streamed for v in c.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset


def test_echo_returns_the_prompt_with_its_logprobs(server, offline):
    client = server.client()
    prompt = PROMPTS[1]
    expected = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, prompt_logprobs=2))[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    choice = got.choices[0]
    assert choice.text == prompt + expected.text
    n = len(expected.prompt_token_ids)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [e.logprob for e in expected.prompt_logprobs + expected.logprobs], abs=1e-4)
    assert "".join(choice.logprobs.tokens[:n]) == prompt
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_a_conversation_resent_finds_its_prompt_in_the_prefix_cache(server):
    """The next turn of a chat resends the earlier ones: their KV blocks are found again, the
    usage says how many prompt tokens were cached (as OpenAI reports them), /metrics counts them,
    and the reply is the one computing the whole prompt gives (deterministic server)."""
    client = server.client()
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 24},
                {"role": "user", "content": "Which planet is the largest?"}]

    def cached_total() -> float:
        text = server.get("/metrics")[1]
        return float(re.search(r"^specfork_prompt_tokens_cached_total (\S+)$", text, re.M).group(1))

    before = cached_total()
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    reused = again.usage.prompt_tokens_details.cached_tokens
    assert 16 * ((first.usage.prompt_tokens - 1) // 16) == reused > 150
    assert cached_total() - before >= reused


def test_echo_with_max_tokens_0_scores_the_prompts_without_generating(server, offline):
    """The legacy OpenAI scoring call (lm-evaluation-harness's loglikelihood): prompts as token
    ids, echo, max_tokens 0 and logprobs. Each choice is its prompt with the prompt's
    log-probabilities and nothing after it, streamed or not."""
    client = server.client()
    prompts = [offline.encode(p) for p in PROMPTS[:2]]
    expected = [offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))[0]
                for ids in prompts]
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, temperature=0, echo=True, logprobs=3)
    assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == sum(len(ids) for ids in prompts)
    for choice, ids, want in zip(got.choices, prompts, expected, strict=True):
        assert choice.finish_reason == "length"
        assert choice.text == offline.engine.tokenizer.decode(ids)
        assert len(choice.logprobs.tokens) == len(ids)  # the prompt's tokens only
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx([e.logprob for e in want.prompt_logprobs], abs=1e-4)
        tops = choice.logprobs.top_logprobs[1:]
        assert [len(t) for t in tops] == [len({*e.top, (e.token_id, e.logprob)}) for e in want.prompt_logprobs]
    streamed = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=0, echo=True, logprobs=1,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == got.choices[0].text
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "length"
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed if c.choices and c.choices[0].logprobs) \
        == len(prompts[0])
    assert streamed[-1].usage.completion_tokens == 0

    status, reply = server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 0}))
    assert status == 400 and "echo" in reply["error"]["message"], reply
    status, reply = server.post("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": [1] * 1024, "max_tokens": 0, "echo": True}))
    assert status == 400 and "context holds 1024" in reply["error"]["message"], reply


def test_n_samples_with_a_seed_are_reproducible_and_differ(server):
    client = server.client()

    def texts(n: int, seed: int, stream: bool = False) -> list[str]:
        reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                          n=n, seed=seed, stream=stream, extra_body={"ignore_eos": True})
        out = [""] * n
        for choice in (c for chunk in reply for c in chunk.choices) if stream else reply.choices:
            out[choice.index] += choice.text
        return out

    first = texts(4, 11)
    assert texts(4, 11) == first  # reproducible
    assert len(set(first)) == 4  # independent samples, not one sample four times
    assert texts(1, 11) == first[:1]  # the first choice is the request's own seed
    assert texts(4, 11, stream=True) == first
    assert texts(4, 12) != first
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=1.0, n=2, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12


# ---- SD and SSD servers: the same log-probabilities as AR --------------------------------------------


@pytest.fixture(scope="module")
def spec_servers():
    args = ("--deterministic", "--max-model-len", "1024")
    # SD at its defaults (k auto, the shipped head); SSD at a small fixed k
    with running_servers(("--mode", "sd", *args), ("--mode", "ssd", "--k", "3", *args)) as (sd, ssd):
        yield {"sd": sd, "ssd": ssd}


def _logprobs(server, chat: bool, stream: bool) -> list[tuple[str, float, list[str]]]:
    """(token, logprob, top tokens) of a greedy answer, through the official client."""
    client = server.client()
    if chat:
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three fruits."}],
                                               max_tokens=16, temperature=0, logprobs=True, top_logprobs=3,
                                               stream=stream)
        items = [e for c in reply if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content] \
            if stream else reply.choices[0].logprobs.content
        return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in items]
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=3,
                                      stream=stream)
    parts = [c.choices[0].logprobs for c in reply if c.choices[0].logprobs] if stream else [reply.choices[0].logprobs]
    return [(t, v, sorted(top, key=top.get, reverse=True)[:3])
            for p in parts for t, v, top in zip(p.tokens, p.token_logprobs, p.top_logprobs, strict=True)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_sd_and_ssd_servers_report_ar_logprobs(server, spec_servers, chat):
    reference = _logprobs(server, chat, stream=False)
    assert len(reference) >= 8
    for mode, spec in spec_servers.items():
        for stream in (False, True):
            got = _logprobs(spec, chat, stream)
            assert [t for t, _, _ in got] == [t for t, _, _ in reference], (mode, stream)
            assert [v for _, v, _ in got] == pytest.approx([v for _, v, _ in reference], abs=1e-4), (mode, stream)
            assert [top for _, _, top in got] == [top for _, _, top in reference], (mode, stream)
    assert spec_servers["ssd"].metric("specfork_ssd_cache_lookups_total") > 0
    assert spec_servers["sd"].metric("specfork_spec_rounds_total") > 0


# ---- a tiny model: queue limits, SSD, shutdown ------------------------------------------------------


def test_ssd_server_matches_ar_and_sigterm_stops_it_and_its_drafter(tiny_checkpoints):
    import psutil

    target = str(tiny_checkpoints["llama-gqa-tied"].path)
    draft = str(tiny_checkpoints["llama3-rope-untied-sharded"].path)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = LLM(target, deterministic=True).generate([[1, 5, 9, 13]], params)[0].token_ids
    with running_server("--model", target, "--mode", "ssd", "--draft", draft, "--k", "3", "--deterministic") as s:
        children = psutil.Process(s.proc.pid).children(recursive=True)
        assert children, "no drafter process"
        got = s.client().completions.create(model=target, prompt=[1, 5, 9, 13], max_tokens=20, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert got.choices[0].model_extra["token_ids"] == expected
        assert s.metric("specfork_ssd_cache_lookups_total") > 0
        # a request in flight when SIGTERM arrives: it may finish (graceful timeout), then the
        # server exits cleanly and takes its drafter with it
        stream = s.client().completions.create(model=target, prompt=[1, 2, 3], max_tokens=450, stream=True,
                                               extra_body={"ignore_eos": True})
        next(iter(stream))
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(90) == 0, "".join(s.log)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_bench_serve_reports_each_rate(tiny_checkpoints, tmp_path, capsys):
    from specfork.cli import main

    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    with running_server("--model", path) as s:
        for label in ("first", "second"):
            rc = main(["bench-serve", "--base-url", s.url, "--dataset", "random", "--num-prompts", "6",
                       "--input-len", "8", "--output-len", "10", "--request-rate", "20,inf", "--label", label,
                       "--out", str(tmp_path), "--no-progress"])
            assert rc == 0
        # every request refused: said why, exit 1, nothing merged into the directory's table (was exit 0)
        refused = main(["bench-serve", "--base-url", s.url, "--dataset", "random", "--num-prompts", "2",
                        "--input-len", "8", "--output-len", "100000", "--request-rate", "inf", "--label", "refused",
                        "--out", str(tmp_path), "--no-progress"])
    assert refused == 1 and not (tmp_path / "refused.json").exists()
    err = capsys.readouterr().err
    assert "2 of 2 requests failed at rate inf: BadRequestError" in err and "no request completed" in err
    run = json.loads((tmp_path / "first.json").read_text())
    assert [r["request_rate"] for r in run["rates"]] == [20.0, float("inf")]
    for r in run["rates"]:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["output_tokens"] == 60
        assert 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p50"] <= r["e2e_s"]["p99"]
        assert r["tpot_s"]["mean"] > 0
    table = (tmp_path / "serve_results.md").read_text()
    assert "first" in table and "second" in table and "refused" not in table  # both runs in one table
    assert (tmp_path / "serve_latency.png").stat().st_size > 0


def test_bench_serve_without_a_server_is_a_clear_error(capsys):
    from specfork.cli import main

    assert main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--no-progress"]) == 2
    assert "no OpenAI-compatible server answers" in capsys.readouterr().err


def test_bench_serve_refuses_an_input_len_its_dataset_would_ignore(capsys):
    """ShareGPT's prompts keep their lengths: --input-len there was silently ignored."""
    from specfork.bench.serve_bench import DEFAULT_RANDOM_INPUT_LEN, ServeBenchSettings, _requests
    from specfork.cli import main

    assert main(["bench-serve", "--input-len", "512", "--no-progress"]) == 2
    assert "--input-len sets the length of --dataset random's prompts" in capsys.readouterr().err
    assert ServeBenchSettings(dataset="random").input_len == DEFAULT_RANDOM_INPUT_LEN  # recorded with the results
    random_prompts = _requests(ServeBenchSettings(dataset="random", num_prompts=2), vocab_size=100)
    assert [len(body["prompt"]) for body in random_prompts] == [DEFAULT_RANDOM_INPUT_LEN] * 2
    assert len(_requests(ServeBenchSettings(dataset="random", input_len=7, num_prompts=1), 100)[0]["prompt"]) == 7


def test_an_empty_api_key_is_refused_not_taken_as_none(capsys, monkeypatch):
    """`--api-key "$UNSET_VAR"` served every route without authentication."""
    from specfork.cli import main

    assert main(["serve", "--api-key", ""]) == 2
    assert "must not be empty" in capsys.readouterr().err
    monkeypatch.setenv("SPECFORK_API_KEY", "")
    assert main(["serve"]) == 2
    assert "SPECFORK_API_KEY" in capsys.readouterr().err
    monkeypatch.delenv("SPECFORK_API_KEY")
    assert main(["serve", "--mode", "ssd", "--k", "auto"]) == 2  # the engine's options, before "loading"
    err = capsys.readouterr().err
    assert "k 'auto' is for SD" in err and "loading" not in err


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_through_the_openai_client(server, offline):
    """response_format (json_schema, json_object) and vLLM's guided_choice and guided_regex: the
    output follows them, as offline generation with the same structured output gives it."""
    client = server.client()
    ask = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    want = offline.chat([ask], SamplingParams(temperature=0, max_tokens=64,
                                              structured_outputs=StructuredOutputs(json=SCHEMA)))[0]
    assert reply.choices[0].message.content == want.text and reply.choices[0].finish_reason == "stop"
    assert list(json.loads(want.text)) == ["name", "age"]  # the schema's order
    chunks = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=64, temperature=0, stream=True,
                                            response_format={"type": "json_object"})
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(streamed), dict)
    picked = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["Paris", "Lyon", "Marseille"],
                                                   "guided_decoding_backend": "xgrammar"})  # any library: the same
    assert picked.choices[0].text in ("Paris", "Lyon", "Marseille") and picked.choices[0].finish_reason == "stop"
    dated = client.completions.create(model=MODEL, prompt="Today's date, as YYYY-MM-DD:", max_tokens=16,
                                      temperature=0, extra_body={"guided_regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"})
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", dated.choices[0].text), dated.choices[0].text
