"""One engine shared by every HTTP request: it runs on its own thread, and asyncio callers talk to
it through a command queue (in) and one asyncio queue per request group (out).

The engine is not thread-safe, so only the engine thread touches it after start-up: adding,
aborting and stepping all happen there. A request whose caller goes away is aborted at the next
step boundary, which frees its sequence and KV blocks.

Failures stay with the request they belong to: a request the engine refuses (bad input found
at ``add_request``) or fails (its batch or its own post-processing raised) gets a ``Failed``
event and the loop goes on. Only a fault of the loop itself, or steps that fail one after the
other, stop the engine; ``state`` then says ``failed`` and every request gets a 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specfork.engine.sequence import Sequence
from specfork.engine.step import StepHealth
from specfork.engine.text_stream import TextStream
from specfork.errors import SpecforkError
from specfork.llm import LLM
from specfork.outputs import RequestOutput, TokenLogprob
from specfork.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_FAILED_STEPS = 5  # steps in a row whose every request failed: the engine itself is broken
IDLE_POLL_S = 0.5


class QueueFull(Exception):
    """More requests are in the engine than it runs plus its waiting queue holds."""


class EngineStopped(Exception):
    """The engine loop is shutting down (or failed) and takes no more requests."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """The engine took the request (its first event)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """New output of one request: text that is now final, the tokens behind it, and their
    log-probabilities when asked for."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on a request's first piece, when asked for


@dataclass(frozen=True, slots=True)
class Finished:
    """The last event of a request that ran; finish_reason "abort" when the server cut it at
    shutdown."""

    output: RequestOutput


@dataclass(frozen=True, slots=True)
class Failed:
    """The last event of a request that did not finish: ``status`` 400 when the engine refused
    it, 500 when it failed while running, 503 when the engine stopped."""

    status: int
    message: str
    param: str | None = None  # the sampling parameter at fault, for a 400


Event = Admitted | Piece | Finished | Failed


@dataclass(eq=False)
class RequestHandle:
    """One sample of a request group (choice ``index``)."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    group: RequestGroup
    seq: Sequence | None = None
    text: TextStream | None = None
    pieces: int = 0
    done: bool = False


@dataclass(eq=False)
class RequestGroup:
    """The samples of one HTTP request (``n`` per prompt). Their events arrive on one queue as
    ``(index, event)`` pairs, in order for each index."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    handles: list[RequestHandle] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)


@dataclass
class EngineSnapshot:
    """What /metrics and /health read, refreshed by the engine thread after every step."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    steps: int = 0
    health: StepHealth = field(default_factory=StepHealth)


class EngineLoop:
    def __init__(
        self,
        make_llm: Callable[[], LLM],
        *,
        max_queue: int,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> None:
        """``make_llm`` is called on the engine thread (an SSD engine pins the calling thread to the
        target's cores). ``max_queue``: requests allowed to wait beyond the engine's running batch.
        ``on_finished`` sees every output that ends, aborted ones included."""
        self._make_llm = make_llm
        self.max_queue = max_queue
        self.on_finished = on_finished
        self.llm: LLM | None = None
        self.snapshot = EngineSnapshot()
        self.fault: str | None = None  # set once the engine failed for good
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: set[RequestHandle] = set()  # submitted and not yet finished
        self._lock = threading.Lock()
        self._closed = False  # no more submissions (under _lock)
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._cut_at: float | None = None  # draining: cancel what still runs at this time
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
        self._refresh_snapshot()
        return self.llm

    def drain(self, grace_s: float) -> None:
        """Take no more requests; those still running ``grace_s`` seconds from now are cut: each
        ends with finish_reason "abort" (streams get their final chunk)."""
        with self._lock:
            self._closed = True
        self._cut_at = time.monotonic() + grace_s
        self._commands.put(("wake",))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cut what is still running, stop the thread and close the engine (drafter included)."""
        with self._lock:
            self._closed = True
        if not self._thread.is_alive():
            return
        self._stopping.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed and self.fault is None

    @property
    def state(self) -> tuple[str, str | None]:
        """("ok" | "degraded" | "stopping" | "failed", why)."""
        if self.fault is not None:
            return "failed", self.fault
        if not self.alive:
            return "stopping", None
        degraded = self.snapshot.health.degraded
        return ("degraded", degraded) if degraded else ("ok", None)

    # ---- requests (event-loop thread) ----------------------------------------------------------

    def submit(self, prompts: list[list[int]], params: list[SamplingParams]) -> RequestGroup:
        """Queue one request's samples, sample i of ``prompts[i]`` with ``params[i]``; their events
        arrive on ``group.events``."""
        group = RequestGroup(asyncio.get_running_loop())
        group.handles = [RequestHandle(i, ids, p, group) for i, (ids, p) in enumerate(zip(prompts, params, strict=True))]
        with self._lock:
            if self._closed or self.fault is not None or not self._thread.is_alive():
                raise EngineStopped("the engine failed; the server takes no requests" if self.fault
                                    else "the server is shutting down")
            if len(self._active) + len(group.handles) > self.max_active:
                raise QueueFull(
                    f"the server is at capacity ({self.max_active} requests: {self.max_active - self.max_queue} "
                    f"running and {self.max_queue} queued); retry later"
                )
            self._active.update(group.handles)
        self._commands.put(("add", group))
        return group

    def abort(self, group: RequestGroup) -> None:
        """Cancel a request's samples (idempotent; harmless once they finished)."""
        if not group.done:
            self._commands.put(("abort", group))

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
        try:
            self._serve()
        except Exception as e:  # a fault of the engine itself, not of one request
            logger.exception("the engine failed; the server takes no more requests")
            self.fault = f"the engine failed ({type(e).__name__}); see the server log"
        finally:
            with self._lock:
                self._closed = True
            self._end_all()
            self.llm.close()
            self._refresh_snapshot()

    def _serve(self) -> None:
        engine = self.llm.engine
        failed_steps = 0
        while not self._stopping.is_set():
            self._apply_commands(block=not engine.has_unfinished())
            if self._stopping.is_set():
                return
            if self._cut_at is not None and time.monotonic() >= self._cut_at:
                self._cut_all()
            if not engine.has_unfinished():
                try:
                    engine.idle()
                except Exception:  # housekeeping: never worth the server (the next request retries it)
                    logger.exception("looking after the engine's helpers between requests failed")
            else:
                updates = engine.step()
                self.snapshot.steps += 1
                failed_steps = failed_steps + 1 if updates and all(u.error for u in updates) else 0
                self._deliver(updates)
                if failed_steps >= MAX_FAILED_STEPS:
                    raise RuntimeError(f"{failed_steps} steps in a row failed every request they ran")
            self._refresh_snapshot()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
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
        if kind == "add":
            for handle in command[1].handles:
                self._add(handle)
        elif kind == "abort":
            for handle in command[1].handles:
                if not handle.done:
                    self._abort(handle)
                    self._finish(handle, None)

    def _add(self, handle: RequestHandle) -> None:
        if handle.done:
            return
        engine = self.llm.engine
        try:
            handle.seq = engine.add_request(handle.prompt_ids, handle.params)
            handle.text = TextStream(engine, handle.seq)
        except SpecforkError as e:  # the engine's own rules (e.g. prompt + max_tokens too long)
            self._finish(handle, Failed(400, str(e), e.param))
            return
        except Exception:
            logger.exception("adding a request failed")
            self._finish(handle, Failed(500, "internal error: the request could not be started"))
            return
        self._emit(handle, Admitted())

    def _deliver(self, updates) -> None:
        by_seq = {h.seq: h for h in list(self._active) if h.seq is not None}
        for update in updates:
            handle = by_seq.get(update.seq)
            if handle is None:
                continue
            try:
                if update.error is not None:
                    self._record(handle)
                    self._finish(handle, Failed(500, "internal error while generating; the request was cancelled"))
                    continue
                piece = handle.text.next_piece()
                if piece or update.new_token_ids:
                    self._emit(handle, self._piece(handle, piece, list(update.new_token_ids), update.new_logprobs))
                if update.finished:
                    self._finish(handle, Finished(self._record(handle)))
            except Exception:  # this request's own post-processing: it alone fails
                logger.exception("delivering the output of a request failed")
                self._abort(handle)
                self._finish(handle, Failed(500, "internal error while generating; the request was cancelled"))

    def _record(self, handle: RequestHandle) -> RequestOutput:
        """The output of a request that ended, counted by ``on_finished``."""
        output = self.llm.engine.output(handle.seq)
        if self.on_finished is not None:
            self.on_finished(output)
        return output

    def _abort(self, handle: RequestHandle) -> None:
        """Stop a request inside the engine (client gone, or cut); counted as "abort"."""
        if handle.seq is not None and not handle.seq.is_finished:
            self.llm.engine.abort(handle.seq)
            self._record(handle)

    def _cut_all(self) -> None:
        """Shutdown's grace period is over: end everything still running with "abort"."""
        for handle in list(self._active):
            if handle.seq is None:
                self._finish(handle, Failed(503, "the server is shutting down; the request was not started"))
                continue
            self._abort(handle)
            piece = handle.text.next_piece() if handle.text is not None else ""
            if piece:
                self._emit(handle, self._piece(handle, piece, [], None))
            self._finish(handle, Finished(self.llm.engine.output(handle.seq)))

    def _end_all(self) -> None:
        """The loop is leaving: cut what runs (or fail it, after an engine fault)."""
        if self.fault is None:
            try:
                self._cut_all()
            except Exception:
                logger.exception("cancelling the requests in flight failed")
        message = "the engine failed; the request was cancelled" if self.fault else "the server is shutting down"
        for handle in list(self._active):
            self._finish(handle, Failed(503, message))

    def _refresh_snapshot(self) -> None:
        engine = self.llm.engine
        blocks = engine.block_manager
        self.snapshot.running = len(engine.scheduler.running)
        self.snapshot.waiting = len(engine.scheduler.waiting)
        self.snapshot.kv_blocks_total = blocks.num_blocks
        self.snapshot.kv_blocks_used = blocks.num_used_blocks
        self.snapshot.health = engine.health()

    @staticmethod
    def _piece(handle: RequestHandle, text: str, token_ids: list[int], logprobs) -> Piece:
        prompt = handle.seq.prompt_logprobs
        first = handle.pieces == 0 and prompt is not None
        handle.pieces += 1
        return Piece(text, token_ids, logprobs, list(prompt) if first else None)

    def _emit(self, handle: RequestHandle, event: Event) -> None:
        try:
            handle.group.loop.call_soon_threadsafe(handle.group.events.put_nowait, (handle.index, event))
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
