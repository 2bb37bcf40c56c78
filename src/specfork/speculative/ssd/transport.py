"""The drafter and the connection to it, as the target sees them.

:class:`DrafterProcess`: a fresh interpreter on this host (not fork: the parent's OpenMP pools
do not survive a fork; not multiprocessing's spawn: that re-imports the user's ``__main__``)
talking over a socket pair. Whatever happens to the owning object, the process does not outlive
it; a failed one is restarted by the proposer.

:class:`DrafterRank`: the drafter as a rank of the torch.distributed world (its own GPU, or
another host under torchrun), the same messages carried by :class:`RankConnection`. A rank
cannot rejoin a world, so one that fails is not restarted: its sequences go on in-process.
"""

from __future__ import annotations

import logging
import pickle
import queue
import socket
import subprocess
import sys
import threading
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from specfork.speculative.ssd.messages import DrafterLaunch

logger = logging.getLogger(__name__)


class DrafterError(Exception):
    """The drafter process failed: it is gone, did not answer in time or answered nonsense."""


class DrafterProcess:
    restartable = True  # the proposer may start a new one after a failure

    def __init__(self, launch: DrafterLaunch | None = None) -> None:
        """Start the process; with ``launch`` also send it, and the draft loads in the
        background. Without, the interpreter starts (imports torch) and waits for ``send(launch)``."""
        parent_sock, child_sock = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specfork.speculative.ssd.worker", str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),),
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self._finalizer = weakref.finalize(self, _kill, self.process)
        if launch is not None:
            self.send(launch)

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message) -> None:
        if self.conn.closed:
            raise DrafterError("the connection to the drafter process is closed")
        try:
            self.conn.send(message)
        except (OSError, ValueError) as e:
            raise DrafterError(f"the drafter process is gone ({type(e).__name__}: {e})") from None

    def receive(self, timeout: float):
        """The next message, waiting at most ``timeout`` seconds."""
        try:
            if not self.conn.poll(timeout):
                raise DrafterError(f"the drafter process did not answer within {timeout:.1f} s")
            return self.conn.recv()
        except (EOFError, OSError) as e:
            raise DrafterError(f"the drafter process is gone ({type(e).__name__}: {e})") from None
        except DrafterError:
            raise
        except Exception as e:  # an undecodable reply: treat the drafter as broken
            raise DrafterError(f"unreadable reply from the drafter process ({type(e).__name__}: {e})") from None

    def request(self, message, timeout: float):
        self.send(message)
        return self.receive(timeout)

    def ready(self, timeout: float) -> dict | None:
        """The drafter's start-up report once it loaded its draft; None while it is still
        loading (``timeout`` 0 just looks). Raises if it failed to start."""
        try:
            if not self.conn.poll(timeout):
                return None
        except (EOFError, OSError) as e:
            raise DrafterError(f"the drafter process is gone ({type(e).__name__}: {e})") from None
        reply = self.receive(0)
        if reply[0] != "ready":
            raise DrafterError(f"the drafter process could not start: {reply[1]}")
        return reply[1]

    def close(self) -> None:
        """Stop the process and close the connection (idempotent). The drafter holds nothing worth
        a graceful exit, and its interpreter's own teardown would take over a second: SIGKILL."""
        _kill(self.process)
        self.conn.close()


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        logger.error("SSD: drafter process %d did not exit after SIGKILL", process.pid)


CLOSE_TIMEOUT_S = 2.0  # how long closing waits on a peer (a hung one must not hold the target up)


class RankConnection:
    """A ``multiprocessing.connection.Connection`` look-alike (send, poll, recv, close) to one
    peer rank, over torch.distributed point-to-point messages.

    A message is one send of at most ``FRAME`` bytes: an 8-byte length, then the pickle; a
    longer pickle's rest follows in a second send of exactly that size (a gloo receive accepts
    fewer bytes than its buffer, not more). Most messages (greedy requests and replies) thus
    cost one send where a length-then-payload protocol costs two (a request and its reply took
    0.37 ms round trip between two processes here).

    A gloo send completes only once the peer has posted the matching receive, so a thread keeps
    one posted at all times: a sender never waits for the other side to finish its work (the
    drafter pre-drafting between requests). ``close`` sends an end-of-stream mark (length -1)
    that ends the peer's thread, so neither side leaves the world with a receive pending; a
    broken peer ends it too. After either, ``recv`` raises ``EOFError``, as on a closed pipe.
    """

    FRAME = 1 << 16

    def __init__(self, peer: int, send_timeout_s: float, group=None) -> None:
        """``group``: the process group that carries CPU tensors (None: the default one)."""
        self.peer = peer
        self._group = group
        self._send_timeout = timedelta(seconds=send_timeout_s)
        self._inbox: queue.Queue = queue.Queue()
        self._next = None
        self.closed = False
        self._receiver = threading.Thread(target=self._receive, name=f"rank-{peer}-receiver", daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        head = 8
        try:
            while True:
                frame = torch.empty(self.FRAME, dtype=torch.uint8)
                dist.recv(frame, self.peer, group=self._group)
                size = int(frame[:head].view(torch.int64))
                if size < 0:
                    self._inbox.put(EOFError(f"rank {self.peer} closed the connection"))
                    return
                data = frame[head : head + size].numpy().tobytes()
                if size > self.FRAME - head:
                    rest = torch.empty(size - (self.FRAME - head), dtype=torch.uint8)
                    dist.recv(rest, self.peer, group=self._group)
                    data += rest.numpy().tobytes()
                self._inbox.put(data)
        except Exception as e:  # the peer or the world is gone
            self._inbox.put(EOFError(f"rank {self.peer} is gone ({_why(e)})"))

    def _send_bytes(self, size: int, data: bytes, timeout: timedelta) -> None:
        framed = torch.frombuffer(bytearray(size.to_bytes(8, "little", signed=True) + data), dtype=torch.uint8)
        dist.isend(framed[: self.FRAME], self.peer, group=self._group).wait(timeout)
        if framed.numel() > self.FRAME:
            dist.isend(framed[self.FRAME :], self.peer, group=self._group).wait(timeout)

    def send(self, message, timeout_s: float | None = None) -> None:
        """Send ``message``, waiting at most ``timeout_s`` (default: the world's timeout) for the
        peer to take it."""
        if self.closed:
            raise OSError(f"the connection to rank {self.peer} is closed")
        data = pickle.dumps(message)
        timeout = self._send_timeout if timeout_s is None else timedelta(seconds=timeout_s)
        try:
            self._send_bytes(len(data), data, timeout)
        except RuntimeError as e:
            raise ConnectionResetError(f"rank {self.peer} is gone ({_why(e)})") from None

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._next is None:
            try:
                self._next = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self):
        if self._next is None:
            self._next = self._inbox.get()
        if isinstance(self._next, EOFError):
            raise self._next  # and again on every later call
        data, self._next = self._next, None
        return pickle.loads(data)

    def close(self) -> None:
        """Tell the peer no more messages come, and wait briefly for its own mark (idempotent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send_bytes(-1, b"", timedelta(seconds=CLOSE_TIMEOUT_S))
        except RuntimeError:
            return  # the peer is gone or hung: either way it gets nothing more
        self._receiver.join(timeout=CLOSE_TIMEOUT_S)


def _why(error: Exception) -> str:
    text = str(error)
    if "closed by peer" in text.lower():
        return "connection closed"
    if "timed out" in text.lower():
        return "timed out"
    return text.splitlines()[0][:160]


class DrafterRank(DrafterProcess):
    """The drafter as rank ``rank`` of the engine's torch.distributed world (parallel/world.py),
    with :class:`DrafterProcess`'s messages and failure handling, minus the restarts."""

    restartable = False

    def __init__(self, world, rank: int, launch: DrafterLaunch | None = None) -> None:
        self.rank = rank
        self.process = world.processes.get(rank)  # None when torchrun started it (maybe on another host)
        self.conn = RankConnection(rank, world.plan.timeout_s, world.message_group)
        if launch is not None:
            self.send(launch)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def close(self) -> None:
        """Ask the rank to leave (its process ends) and stop talking to it (idempotent); a local
        rank that does not leave within a few seconds (a hung one) is killed."""
        if self.conn.closed:
            return
        try:
            self.conn.send(("exit",), timeout_s=CLOSE_TIMEOUT_S)
        except (OSError, ValueError):
            pass
        self.conn.close()
        if self.process is not None:
            try:
                self.process.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill(self.process)
