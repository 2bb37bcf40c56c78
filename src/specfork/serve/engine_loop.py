"""One engine shared by every HTTP request: it runs on its own thread, and asyncio callers talk to
it through a command queue (in) and one asyncio queue per request (out).

The engine is not thread-safe, so only the engine thread touches it after start-up: adding,
aborting and stepping all happen there. A request whose caller goes away is aborted at the next
step boundary, which frees its sequence and KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from specfork.engine.sequence import Sequence
from specfork.engine.text_stream import TextStream
from specfork.llm import LLM
from specfork.outputs import RequestOutput
from specfork.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are in the engine than it runs plus its waiting queue holds."""


class EngineStopped(Exception):
    """The engine loop has shut down (or failed) and takes no more requests."""


@dataclass(frozen=True, slots=True)
class Piece:
    """New output of one request: text that is now final, and the tokens behind it."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Finished:
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


Event = Piece | Finished | Failed


@dataclass(eq=False)
class RequestHandle:
    """What a caller holds for one request: events arrive on ``events``; ``aborted`` once cancelled."""

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None
    seq: Sequence | None = None
    text: TextStream | None = None
    done: bool = False


@dataclass
class EngineSnapshot:
    """Counts read by /metrics and /health, refreshed by the engine thread after every step."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    steps: int = 0


class EngineLoop:
    def __init__(
        self,
        make_llm: Callable[[], LLM],
        *,
        max_queue: int,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        """``make_llm`` is called on the engine thread (an SSD engine pins the calling thread to the
        target's cores). ``max_queue``: requests allowed to wait beyond the engine's running batch."""
        self._make_llm = make_llm
        self.max_queue = max_queue
        self.on_finished = on_finished
        self.llm: LLM | None = None
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: set[RequestHandle] = set()  # submitted and not yet finished (any thread reads len)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="specfork-engine", daemon=True)
        self.max_active = 0

    # ---- lifecycle (caller thread) ----------------------------------------------------------

    def start(self) -> LLM:
        """Load the model on the engine thread; raises what loading raised."""
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            raise self._load_error
        assert self.llm is not None
        self.max_active = self.llm.config.max_num_seqs + self.max_queue
        return self.llm

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel what is still running, stop the thread and close the engine (drafter included)."""
        if not self._thread.is_alive():
            return
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    # ---- requests (event-loop thread) ----------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        if not self.alive:
            raise EngineStopped("the engine is shutting down")
        handle = RequestHandle(prompt_ids, params, loop=asyncio.get_running_loop())
        with self._lock:
            if len(self._active) >= self.max_active:
                raise QueueFull(
                    f"the server is at capacity ({self.max_active} requests: {self.max_active - self.max_queue} "
                    f"running and {self.max_queue} queued); retry later"
                )
            self._active.add(handle)
        self._commands.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (idempotent; harmless once it finished)."""
        if not handle.done:
            self._commands.put(("abort", handle))

    @property
    def num_active(self) -> int:
        return len(self._active)

    # ---- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.llm = self._make_llm()
        except BaseException as e:  # reported to start()'s caller
            self._load_error = e
            self._ready.set()
            return
        self._ready.set()
        engine = self.llm.engine
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not engine.has_unfinished())
                if self._stopping.is_set():
                    break
                if engine.has_unfinished():
                    self._step()
        finally:
            for handle in list(self._active):
                self._finish(handle, Failed("the server is shutting down; the request was cancelled"))
            self.llm.close()
            self._refresh_snapshot()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        engine = self.llm.engine
        if kind == "add":
            handle: RequestHandle = command[1]
            if handle.done:
                return
            handle.seq = engine.add_request(handle.prompt_ids, handle.params)
            handle.text = TextStream(engine, handle.seq)
        elif kind == "abort":
            handle = command[1]
            if handle.seq is not None:
                engine.abort(handle.seq)
            self._finish(handle, None)

    def _step(self) -> None:
        engine = self.llm.engine
        try:
            updates = engine.step()
        except Exception as e:  # a bug or an engine fault: fail the requests in flight, keep serving
            logger.exception("engine step failed; cancelling the requests in flight")
            for handle in list(self._active):
                if handle.seq is not None:
                    engine.abort(handle.seq)
                self._finish(handle, Failed(f"internal error while generating: {type(e).__name__}: {e}"))
            return
        by_seq = {h.seq: h for h in self._active if h.seq is not None}
        for update in updates:
            handle = by_seq.get(update.seq)
            if handle is None:
                continue
            piece = handle.text.next_piece()
            if piece or update.new_token_ids:
                self._emit(handle, Piece(piece, list(update.new_token_ids)))
            if update.finished:
                output = engine.output(update.seq)
                if self.on_finished is not None:
                    self.on_finished(output)
                self._finish(handle, Finished(output))
        self.snapshot.steps += 1
        self._refresh_snapshot()

    def _refresh_snapshot(self) -> None:
        engine = self.llm.engine
        blocks = engine.block_manager
        self.snapshot.running = len(engine.scheduler.running)
        self.snapshot.waiting = len(engine.scheduler.waiting)
        self.snapshot.kv_blocks_total = blocks.num_blocks
        self.snapshot.kv_blocks_used = blocks.num_used_blocks

    def _emit(self, handle: RequestHandle, event: Event) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _finish(self, handle: RequestHandle, event: Event | None) -> None:
        if handle.done:
            return
        handle.done = True
        with self._lock:
            self._active.discard(handle)
        if event is not None:
            self._emit(handle, event)
        self._refresh_snapshot()
