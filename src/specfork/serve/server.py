"""Run the OpenAI-compatible server: bind the port, load the engine, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specfork.errors import SpecforkError
from specfork.options import option

if TYPE_CHECKING:
    from specfork.llm import LLM

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 2 * 1024 * 1024
DRAIN_MARGIN_S = 10.0  # uvicorn's own deadline, past ours: cut streams have time to send their end


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port; 0 picks a free one")
    max_queue: int = option(256, "requests that may wait beyond the --max-num-seqs running ones; more are refused "
                            "with 503")
    served_model_name: str | None = option(None, "the model name clients send (default: the --model value)")
    graceful_timeout_s: float = option(30.0, "seconds open requests may take to finish after SIGINT/SIGTERM; then "
                                       "they end with finish_reason abort", flag="--graceful-timeout")
    log_level: str = option("warning", cli=False)  # the command's --log-level
    max_request_bytes: int = option(DEFAULT_MAX_REQUEST_BYTES, "larger request bodies are refused with 413")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every /v1 route and on /tokenize and /detokenize (401 "
                                 "otherwise; /health and /metrics stay open); the "
                                 "environment variable SPECFORK_API_KEY sets it without showing it in the process "
                                 "list")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SpecforkError(f"port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            raise SpecforkError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.graceful_timeout_s < 0:
            raise SpecforkError(f"graceful_timeout_s must be >= 0, got {self.graceful_timeout_s}")
        if self.max_request_bytes < 1:
            raise SpecforkError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise SpecforkError("api_key (--api-key, or SPECFORK_API_KEY) must not be empty; leave it unset to serve "
                                "without a key")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server listens beyond this machine and anyone may call it."""
    if api_key is not None:
        return None
    try:
        local = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        local = host == "localhost"
    if local:
        return None
    return (f"listening on {host} without an API key: anyone who can reach this address can use the model; "
            "set --api-key or SPECFORK_API_KEY")


def bind(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so that a busy port is a clear error and not a late crash."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise SpecforkError(f"port {port} on {host} is already in use; pick another with --port") from None
        raise SpecforkError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(make_llm: Callable[[], LLM], model_name: str, settings: ServerSettings,
          on_ready: Callable[[str], None] | None = None) -> None:
    """Blocks until the server stops. ``on_ready`` receives the base URL once requests are taken."""
    import uvicorn

    from specfork.serve.app import AppOptions, build_app
    from specfork.serve.engine_loop import EngineLoop
    from specfork.serve.metrics import ServerMetrics

    warning = exposure_warning(settings.host, settings.api_key)
    if warning is not None:
        logger.warning(warning)
    sock = bind(settings.host, settings.port)
    metrics = ServerMetrics()
    loop = EngineLoop(make_llm, max_queue=settings.max_queue, on_finished=metrics.request_finished)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # Refuse new requests at once and cut what still runs when the grace period ends,
            # so every stream sends its final chunk before uvicorn's own (later) deadline.
            loop.drain(settings.graceful_timeout_s)
            await super().shutdown(sockets)

    try:
        loop.start()
        options = AppOptions(served_model_name=settings.served_model_name or model_name,
                             max_request_bytes=settings.max_request_bytes, api_key=settings.api_key)
        app = build_app(loop, metrics, options)
        config = uvicorn.Config(app, log_level=settings.log_level, access_log=False,
                                timeout_graceful_shutdown=settings.graceful_timeout_s + DRAIN_MARGIN_S)
        server = Server(config)
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        if on_ready is not None:
            original_startup = server.startup

            async def startup(sockets=None):
                await original_startup(sockets=sockets)
                if server.started:
                    on_ready(url)

            server.startup = startup
        _run_until_signal(server, sock)
    finally:
        loop.shutdown()
        sock.close()


def _run_until_signal(server, sock: socket.socket) -> None:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal to the handler
    that was installed before it ran. For SIGTERM that handler is ours and does nothing, so a
    terminated server returns normally (exit code 0) instead of dying by the signal; SIGINT still
    ends as KeyboardInterrupt (the CLI's exit code 130)."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if in_main else None
    try:
        server.run(sockets=[sock])
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
