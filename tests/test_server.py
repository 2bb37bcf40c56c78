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
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from specfork import LLM, SamplingParams

pytestmark = pytest.mark.dist
openai = pytest.importorskip("openai")

MODEL = "smollm2-135m"
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef normalize(x):",
           "Once upon a time", "SELECT name FROM users WHERE"]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: list[str]) -> None:
        self.proc, self.url, self.log = proc, url, log

    def client(self, **kw):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120, **kw)

    def post(self, path: str, data: bytes | str, content_type: str = "application/json") -> tuple[int, dict]:
        body = data.encode() if isinstance(data, str) else data
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        match = re.search(rf"^{name} (\S+)$", text, re.M)
        assert match, f"{name} missing from /metrics"
        return float(match.group(1))


@contextmanager
def running_server(*args: str, startup_s: float = 180.0):
    proc = subprocess.Popen([sys.executable, "-m", "specfork.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def drain() -> None:
        for line in proc.stderr:
            log.append(line)
            found = re.search(r"serving .* at (http://\S+)/v1", line)
            if found:
                url.append(found.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        assert ready.wait(startup_s) and url, "server did not start:\n" + "".join(log)
        yield Server(proc, url[0], log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server():
    with running_server("--deterministic", "--max-num-seqs", "32", "--max-model-len", "1024") as s:
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
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)

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
    stream.close()  # the client goes away mid-stream
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("specfork_kv_cache_blocks_used") > 0:
        time.sleep(0.2)
    assert server.metric("specfork_kv_cache_blocks_used") == 0
    assert server.metric("specfork_num_requests_running") == 0


BAD_REQUESTS = [
    ("/v1/completions", "{not json", "not valid JSON"),
    ("/v1/completions", "[1, 2]", "JSON object"),
    ("/v1/completions", json.dumps({"prompt": "hi"}), "'model' is required"),
    ("/v1/completions", json.dumps({"model": MODEL}), "'prompt' is required"),
    ("/v1/completions", json.dumps({"model": "gpt-9", "prompt": "hi"}), "does not exist"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}), "temperature"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": 5}), "temperature"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "top_p": 0}), "top_p"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 3}), "n must be 1"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stream": "yes"}), "stream"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 5}), "'logprobs' is not supported"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": ""}), "empty"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [999999]}), "outside the vocabulary"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 1100}), "context"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5000}), "maximum context length"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}), "messages"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}), "role"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hello"}), "messages"),
]


@pytest.mark.parametrize("path,body,message", BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_bad_input_is_a_400_naming_the_problem(server, path, body, message):
    status, reply = server.post(path, body)
    assert status == 400, reply
    assert message in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error"
    # and the server still answers
    assert server.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}))[0] == 200


def test_the_openai_client_sees_bad_requests_as_bad_request_errors(server):
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        server.client().completions.create(model="nope", prompt="hi", max_tokens=2)


def test_metrics_are_prometheus_text(server):
    status, text = server.get("/metrics")
    assert status == 200
    for name in ("specfork_requests_finished_total", "specfork_generation_tokens_total",
                 "specfork_time_to_first_token_seconds_bucket", "specfork_time_per_output_token_seconds_count",
                 "specfork_spec_acceptance_rate", "specfork_ssd_cache_hit_rate", "specfork_num_requests_waiting",
                 "specfork_kv_cache_usage"):
        assert re.search(rf"^{name}(\{{[^}}]*\}})? \S+$", text, re.M), name
    assert server.metric("specfork_generation_tokens_total") > 0


# ---- a tiny model: queue limits, SSD, shutdown ------------------------------------------------------


def test_a_full_queue_is_refused_with_503():
    with running_server("--max-num-seqs", "1", "--max-queue", "0", "--max-model-len", "1024") as s:
        stream = s.client().completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=900, stream=True,
                                               extra_body={"ignore_eos": True})
        next(iter(stream))
        status, reply = s.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}))
        assert status == 503 and "capacity" in reply["error"]["message"], reply
        stream.close()
        deadline = time.time() + 30
        while time.time() < deadline and s.metric("specfork_num_requests_running") > 0:
            time.sleep(0.2)
        assert s.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}))[0] == 200


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


def test_bench_serve_reports_each_rate(tiny_checkpoints, tmp_path):
    from specfork.cli import main

    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    with running_server("--model", path) as s:
        for label in ("first", "second"):
            rc = main(["bench-serve", "--base-url", s.url, "--dataset", "random", "--num-prompts", "6",
                       "--input-len", "8", "--output-len", "10", "--request-rate", "20,inf", "--label", label,
                       "--out", str(tmp_path), "--no-progress"])
            assert rc == 0
    run = json.loads((tmp_path / "first.json").read_text())
    assert [r["request_rate"] for r in run["rates"]] == [20.0, float("inf")]
    for r in run["rates"]:
        assert r["completed"] == 6 and r["failed"] == 0
        assert r["output_tokens"] == 60
        assert 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p50"] <= r["e2e_s"]["p99"]
        assert r["tpot_s"]["mean"] > 0
    table = (tmp_path / "serve_results.md").read_text()
    assert "first" in table and "second" in table  # both runs in one table
    assert (tmp_path / "serve_latency.png").stat().st_size > 0


def test_bench_serve_without_a_server_is_a_clear_error(capsys):
    from specfork.cli import main

    assert main(["bench-serve", "--base-url", "http://127.0.0.1:9", "--no-progress"]) == 2
    assert "no OpenAI-compatible server answers" in capsys.readouterr().err
