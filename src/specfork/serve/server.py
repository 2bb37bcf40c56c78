"""Run the OpenAI-compatible server: bind the port, load the engine, serve until SIGINT/SIGTERM."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from specfork.errors import SpecforkError
from specfork.llm import LLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    served_model_name: str | None = None
    graceful_timeout_s: float = 30.0
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SpecforkError(f"port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            raise SpecforkError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.graceful_timeout_s < 0:
            raise SpecforkError(f"graceful_timeout_s must be >= 0, got {self.graceful_timeout_s}")


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

    from specfork.serve.app import build_app
    from specfork.serve.engine_loop import EngineLoop
    from specfork.serve.metrics import ServerMetrics

    sock = bind(settings.host, settings.port)
    metrics = ServerMetrics()
    loop = EngineLoop(make_llm, max_queue=settings.max_queue, on_finished=metrics.request_finished)
    try:
        loop.start()
        app = build_app(loop, metrics, settings.served_model_name or model_name)
        config = uvicorn.Config(app, log_level=settings.log_level, timeout_graceful_shutdown=settings.graceful_timeout_s,
                                access_log=False)
        server = uvicorn.Server(config)
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
