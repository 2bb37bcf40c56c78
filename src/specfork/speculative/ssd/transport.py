"""The drafter and the connection to it, as the target sees them.

:class:`DrafterProcess`: a fresh interpreter on this host (not fork: the parent's OpenMP pools
do not survive a fork; not multiprocessing's spawn: that re-imports the user's ``__main__``)
talking over a socket pair. Whatever happens to the owning object, the process does not outlive
it; a failed one is restarted by the proposer.

:class:`DrafterRank`: the drafter as a rank of the torch.distributed world (its own GPU, or
another host under torchrun), the same messages carried by parallel/connection.py's
:class:`RankConnection`. A rank cannot rejoin a world, so one that fails is not restarted: its
sequences go on in-process.
"""

from __future__ import annotations

import logging
import socket
import struct
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection

from specfork.parallel.connection import CLOSE_TIMEOUT_S, RankConnection, SendTimeout
from specfork.parallel.world import kill_processes
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
            # Its own session: a terminal's Ctrl-C goes to the target's process group only, and the
            # target stops the drafter itself (a drafter that took the signal died mid-drain, and
            # was restarted while the server shut down).
            start_new_session=True,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self._finalizer = weakref.finalize(self, kill_processes, [self.process])
        if launch is not None:
            self.send(launch)

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message, timeout: float | None = None) -> None:
        """Send ``message``; ``timeout``: how long the drafter may take to accept it (None: no
        limit). The socket's buffer takes a small message at once; a large one (an EAGLE-3 head's
        features for a big batch) waits for the drafter to read, and a drafter stopped mid-round
        must fail the round within its timeout, not hold it for ever."""
        if self.conn.closed:
            raise DrafterError("the connection to the drafter process is closed")
        try:
            self._send(message, timeout)
        except (BlockingIOError, SendTimeout) as e:  # the send's timeout passed (part of the message may have gone: the caller closes us)
            within = f"within {timeout:.1f} s" if timeout is not None else f"in time ({e})"  # None: the world's timeout
            raise DrafterError(f"the drafter did not take a request {within}") from None
        except (OSError, ValueError) as e:
            raise DrafterError(f"the drafter process is gone ({type(e).__name__}: {e})") from None

    def _send(self, message, timeout: float | None) -> None:
        # SO_SNDTIMEO: a blocked write gives up (EAGAIN) after it; 0: never. Set on the connection's
        # own socket, borrowed (a second descriptor would keep the socket open for the drafter
        # after the connection closes).
        seconds = 0.0 if timeout is None else max(timeout, 1e-3)
        whole = int(seconds)
        sock = socket.socket(fileno=self.conn.fileno())
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6)))
        finally:
            sock.detach()
        self.conn.send(message)

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
        """Send ``message`` and wait for the reply, each within ``timeout`` seconds."""
        self.send(message, timeout)
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
        kill_processes([self.process])
        self.conn.close()


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

    def _send(self, message, timeout: float | None) -> None:
        """A rank takes a message only when its receiver thread has a receive posted; a hung rank
        that has not must fail the round within its timeout, not the world's (minutes)."""
        self.conn.send(message, timeout_s=timeout)

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
                kill_processes([self.process])
