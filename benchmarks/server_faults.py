"""Load and fault figures of `specfork serve` on the embedded model, on 127.0.0.1 only:

* 64 concurrent greedy streams per mode (ar, sd, ssd): completed, errors, outputs equal to
  offline (batched) generation, and the prompts whose output differs;
* overload: 64 concurrent requests against 4 running + 4 queued: how many got 503 (with
  Retry-After), whether the others' outputs are right;
* shutdown: SIGINT with 8 long streams in flight: how many ended cleanly (a final chunk with
  finish_reason "abort", then [DONE]), and how long the server took to exit;
* drafter stall: SIGSTOP on the SSD drafter mid-stream: the longest pause of the stream, and
  how long until /health is "ok" again (a new drafter process);
* idle shutdown: seconds from SIGTERM to exit.

Every phase has a time limit. Servers are started as users start them (`python -m specfork.cli
serve`, through the test suite's launcher).

    python benchmarks/server_faults.py --out benchmarks/server_faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import threading
import urllib.request
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import running_server  # noqa: E402  (the test suite's server launcher)

from specfork import LLM, SamplingParams  # noqa: E402
from specfork.bench.timing import clock  # noqa: E402

MODEL = "smollm2-135m"
BASES = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n\ndef normalize(x):",
         "Once upon a time", "SELECT name FROM users WHERE"]
COMMON = ("--deterministic", "--max-model-len", "1024", "--k", "3")


def prompts(n: int) -> list[str]:
    return [f"{BASES[i % len(BASES)]} {i}" for i in range(n)]


async def streams(url: str, texts: list[str], max_tokens: int) -> list[str | Exception]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    try:
        return await asyncio.gather(*(one(p) for p in texts), return_exceptions=True)
    finally:
        await client.close()


def load_phase(mode: str, texts: list[str], expected: list[str], max_tokens: int) -> dict:
    with running_server("--mode", mode, *COMMON) as server:
        started = clock()
        results = asyncio.run(asyncio.wait_for(streams(server.url, texts, max_tokens), 900))
        elapsed = clock() - started
    errors = [r for r in results if isinstance(r, Exception)]
    return {"mode": mode, "streams": len(texts), "completed": len(texts) - len(errors), "errors": len(errors),
            "outputs_correct": sum(r == e for r, e in zip(results, expected, strict=True)),
            "mismatched_prompts": [texts[i] for i, (r, e) in enumerate(zip(results, expected, strict=True))
                                   if not isinstance(r, Exception) and r != e],
            "seconds": elapsed, "error_kinds": sorted({type(e).__name__ for e in errors})}


def overload_phase(texts: list[str], expected: list[str], max_tokens: int) -> dict:
    with running_server("--max-num-seqs", "4", "--max-queue", "4", *COMMON) as server:
        def post(i: int, out: list) -> None:
            body = json.dumps({"model": MODEL, "prompt": texts[i], "max_tokens": max_tokens, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    out[i] = (r.status, json.loads(r.read())["choices"][0]["text"], None)
            except urllib.error.HTTPError as e:
                out[i] = (e.code, None, e.headers.get("Retry-After"))

        out: list = [None] * len(texts)
        threads = [threading.Thread(target=post, args=(i, out)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
    ok = [i for i, r in enumerate(out) if r and r[0] == 200]
    refused = [r for r in out if r and r[0] == 503]
    return {"requests": len(texts), "served": len(ok), "refused_503": len(refused),
            "refused_with_retry_after": sum(r[2] is not None for r in refused),
            "other": len(texts) - len(ok) - len(refused),
            "served_outputs_correct": sum(out[i][1] == expected[i] for i in ok),
            "mismatched_prompts": [texts[i] for i in ok if out[i][1] != expected[i]]}


def _read_stream(url: str, prompt: str, first: threading.Event, out: list) -> None:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 900, "stream": True, "ignore_eos": True})
    req = urllib.request.Request(url + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.strip():
                    out.append(line.decode().strip())
                    first.set()
    except Exception as e:
        out.append(f"ERROR {e!r}")
    first.set()


def shutdown_phase(texts: list[str], grace_s: float) -> dict:
    with running_server("--graceful-timeout", str(grace_s), *COMMON) as server:
        lines = [[] for _ in range(8)]
        firsts = [threading.Event() for _ in lines]
        threads = [threading.Thread(target=_read_stream, args=(server.url, texts[i], firsts[i], lines[i]))
                   for i in range(8)]
        for t in threads:
            t.start()
        for e in firsts:
            e.wait(300)
        code, seconds = server.stop(signal.SIGINT)
        for t in threads:
            t.join(120)

    def clean(stream: list[str]) -> bool:
        if len(stream) < 2 or stream[-1] != "data: [DONE]":
            return False
        return json.loads(stream[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"

    return {"streams": 8, "clean_ends": sum(clean(s) for s in lines), "grace_s": grace_s,
            "exit_seconds_after_signal": seconds, "exit_code": code}


def drafter_phase() -> dict:
    import psutil

    with running_server("--mode", "ssd", *COMMON) as server:
        client = server.client()
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
        (drafter,) = psutil.Process(server.proc.pid).children()
        arrivals = []
        stream = client.completions.create(model=MODEL, prompt="Write a long story.", max_tokens=160, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        stopped_at = None
        try:
            for _ in stream:
                arrivals.append(clock())
                if len(arrivals) == 5:
                    os.kill(drafter.pid, signal.SIGSTOP)
                    stopped_at = clock()
            deadline = clock() + 300
            while json.loads(server.get("/health")[1])["status"] != "ok" and clock() < deadline:
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
            recovered = clock() - stopped_at
        finally:
            if drafter.is_running():
                os.kill(drafter.pid, signal.SIGCONT)
        failures = server.metric("specfork_drafter_failures_total")
        restarts = server.metric("specfork_drafter_restarts_total")
        code, idle_exit = server.stop(signal.SIGTERM)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"seconds_frozen": max(gaps), "typical_gap_s": sorted(gaps)[len(gaps) // 2],
            "health_ok_again_after_s": recovered, "drafter_failures": failures, "drafter_restarts": restarts,
            "idle_ssd_exit_seconds": idle_exit, "exit_code": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--modes", default="ar,sd,ssd")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    texts = prompts(args.streams)
    started = clock()
    offline = LLM(deterministic=True, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    expected = [o.text for o in offline.generate(texts, params)]
    offline.close()
    del offline
    report = {"machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs", "load": []}
    for mode in args.modes.split(","):
        report["load"].append(load_phase(mode, texts, expected, args.max_tokens))
        print(json.dumps(report["load"][-1]), flush=True)
    report["overload"] = overload_phase(texts, expected, args.max_tokens)
    print(json.dumps({"overload": report["overload"]}), flush=True)
    report["shutdown"] = shutdown_phase(texts, grace_s=2.0)
    print(json.dumps({"shutdown": report["shutdown"]}), flush=True)
    report["drafter_stall"] = drafter_phase()
    print(json.dumps({"drafter_stall": report["drafter_stall"]}), flush=True)
    report["total_seconds"] = clock() - started
    print(f"total {report['total_seconds']:.0f} s")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
