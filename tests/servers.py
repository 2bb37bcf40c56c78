"""Test helpers: `specfork serve` subprocesses, started as users start them, and small HTTP calls."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: list[str]) -> None:
        self.proc, self.url, self.log = proc, url, log
        self.last_headers = None

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", "x")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=120, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=300, **kw)

    def post(self, path: str, data: bytes | str, content_type: str = "application/json",
             headers: dict | None = None, timeout: float = 120) -> tuple[int, dict]:
        body = data.encode() if isinstance(data, str) else data
        req = urllib.request.Request(self.url + path, data=body,
                                     headers={"Content-Type": content_type, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                self.last_headers = r.headers
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            self.last_headers = e.headers
            return e.code, json.loads(e.read())

    def get(self, path: str, headers: dict | None = None) -> tuple[int, str]:
        req = urllib.request.Request(self.url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str, labels: str = "") -> float:
        """``labels`` as written in the exposition, e.g. 'finish_reason="abort"'."""
        _, text = self.get("/metrics")
        selector = re.escape(f"{{{labels}}}") if labels else ""
        match = re.search(rf"^{name}{selector} (\S+)$", text, re.M)
        assert match, f"{name}{{{labels}}} missing from /metrics"
        return float(match.group(1))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> tuple[int, float]:
        """Send ``sig`` and wait for the exit: (exit code, seconds it took)."""
        started = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout)
        return code, time.monotonic() - started


class _Starting:
    """A server process whose start-up line is awaited on a reader thread."""

    def __init__(self, args: tuple[str, ...]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "specfork.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.url: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            found = re.search(r"serving .* at (http://\S+)/v1", line)
            if found:
                self.url.append(found.group(1))
                self.ready.set()
        self.ready.set()

    def wait(self, timeout: float) -> Server:
        assert self.ready.wait(timeout) and self.url, "server did not start:\n" + "".join(self.log)
        return Server(self.proc, self.url[0], self.log)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def running_servers(*arg_lists: tuple[str, ...], startup_s: float = 240.0):
    """Start every server at once (their start-ups overlap), yield them when all are ready, and
    stop whatever still runs at the end. Servers inherit this process's environment."""
    with ExitStack() as stack:
        starting = []
        for args in arg_lists:
            item = _Starting(args)
            stack.callback(item.terminate)
            starting.append(item)
        yield [item.wait(startup_s) for item in starting]


@contextmanager
def running_server(*args: str, startup_s: float = 240.0):
    with running_servers(args, startup_s=startup_s) as (server,):
        yield server


@contextmanager
def inprocess_server(make_llm, *, served_model_name: str = "tiny", max_request_bytes: int = 1_000_000,
                     api_key: str | None = None):
    """The app over an engine loop, served by uvicorn on a thread of this process (so a test can
    reach inside the engine). Yields (Server without a process, EngineLoop)."""
    import uvicorn

    from specfork.serve.app import AppOptions, build_app
    from specfork.serve.engine_loop import EngineLoop
    from specfork.serve.metrics import ServerMetrics
    from specfork.serve.server import bind

    metrics = ServerMetrics()
    loop = EngineLoop(make_llm, max_queue=8, on_finished=metrics.request_finished)
    loop.start()
    options = AppOptions(served_model_name=served_model_name, max_request_bytes=max_request_bytes, api_key=api_key)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(loop, metrics, options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started, "the in-process server did not start"
        yield Server(None, "http://127.0.0.1:%d" % sock.getsockname()[1], []), loop
    finally:
        server.should_exit = True
        thread.join(30)
        loop.shutdown()
        sock.close()
