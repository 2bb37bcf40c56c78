"""Messages between ranks over torch.distributed point-to-point sends (gloo, CPU tensors).

A message is one frame of at most ``FRAME`` bytes: an 8-byte length, then the pickle; a longer
pickle's rest follows in a second send of exactly that size (a gloo receive accepts fewer bytes
than its buffer, not more). Most messages thus cost one send where a length-then-payload
protocol costs two (a request and its reply took 0.37 ms round trip between two processes here).
A length of -1 marks the end of the stream.

Sends wait at most a given time for the peer to take them; receives are posted on a group with
the world's idle timeout (parallel/world.py), since a rank may wait long for its next message.
"""

from __future__ import annotations

import pickle
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from specfork.parallel.world import brief

FRAME = 1 << 16
_HEAD = 8
CLOSE_TIMEOUT_S = 2.0  # how long closing waits on a peer (a hung one must not hold anyone up)


def send_frame(data: bytes | None, peer: int, group, timeout: timedelta) -> None:
    """Send ``data`` (None: the end-of-stream mark) to global rank ``peer``; raises RuntimeError
    if the peer does not take it within ``timeout`` or is gone."""
    size = -1 if data is None else len(data)
    framed = torch.frombuffer(bytearray(size.to_bytes(_HEAD, "little", signed=True) + (data or b"")),
                              dtype=torch.uint8)
    dist.isend(framed[:FRAME], peer, group=group).wait(timeout)
    if framed.numel() > FRAME:
        dist.isend(framed[FRAME:], peer, group=group).wait(timeout)


def recv_frame(peer: int, group) -> bytes | None:
    """The next message from global rank ``peer`` (None: the end-of-stream mark)."""
    frame = torch.empty(FRAME, dtype=torch.uint8)
    dist.recv(frame, peer, group=group)
    size = int(frame[:_HEAD].view(torch.int64))
    if size < 0:
        return None
    data = frame[_HEAD : _HEAD + size].numpy().tobytes()
    if size > FRAME - _HEAD:
        rest = torch.empty(size - (FRAME - _HEAD), dtype=torch.uint8)
        dist.recv(rest, peer, group=group)
        data += rest.numpy().tobytes()
    return data


class SendTimeout(ConnectionResetError):
    """The peer did not take a message in time: hung, or busy past the timeout, rather than known
    to be gone (a ConnectionResetError still, so that whoever ends on a lost peer ends on it)."""


class RankConnection:
    """A ``multiprocessing.connection.Connection`` look-alike (send, poll, recv, close) to one
    peer rank.

    A gloo send completes only once the peer has posted the matching receive, so a thread keeps
    one posted at all times: a sender never waits for the other side to finish its work (SSD's
    drafter pre-drafting between requests). ``close`` sends the end-of-stream mark, which ends
    the peer's thread, so neither side leaves the world with a receive pending; a broken peer
    ends it too. After either, ``recv`` raises ``EOFError``, as on a closed pipe.
    """

    def __init__(self, peer: int, send_timeout_s: float, group=None) -> None:
        """``group``: the process group of the messages (the world's ``message_group``)."""
        self.peer = peer
        self._group = group
        self._send_timeout = timedelta(seconds=send_timeout_s)
        self._inbox: queue.Queue = queue.Queue()
        self._next = None
        self.closed = False
        self._receiver = threading.Thread(target=self._receive, name=f"rank-{peer}-receiver", daemon=True)
        self._receiver.start()

    def _receive(self) -> None:
        try:
            while True:
                data = recv_frame(self.peer, self._group)
                if data is None:
                    self._inbox.put(EOFError(f"rank {self.peer} closed the connection"))
                    return
                self._inbox.put(data)
        except Exception as e:  # the peer or the world is gone
            self._inbox.put(EOFError(f"rank {self.peer} is gone ({brief(e)})"))

    def send(self, message, timeout_s: float | None = None) -> None:
        """Send ``message``, waiting at most ``timeout_s`` (default: the world's timeout) for the
        peer to take it."""
        if self.closed:
            raise OSError(f"the connection to rank {self.peer} is closed")
        timeout = self._send_timeout if timeout_s is None else timedelta(seconds=timeout_s)
        try:
            send_frame(pickle.dumps(message), self.peer, self._group, timeout)
        except RuntimeError as e:
            if brief(e) == "timed out":
                raise SendTimeout(f"rank {self.peer} did not take a message within {timeout.total_seconds():.1f} s") from None
            raise ConnectionResetError(f"rank {self.peer} is gone ({brief(e)})") from None

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
            send_frame(None, self.peer, self._group, timedelta(seconds=CLOSE_TIMEOUT_S))
        except RuntimeError:
            return  # the peer is gone or hung: either way it gets nothing more
        self._receiver.join(timeout=CLOSE_TIMEOUT_S)
