"""One drafter process and the connection to it, as the target sees them.

The process is a fresh interpreter (not fork: the parent's OpenMP pools do not survive a fork;
not multiprocessing's spawn: that re-imports the user's ``__main__``) talking over a socket
pair. Whatever happens to the owning object, the process does not outlive it.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection

from specfork.speculative.ssd.messages import DrafterLaunch

logger = logging.getLogger(__name__)


class DrafterError(Exception):
    """The drafter process failed: it is gone, did not answer in time or answered nonsense."""


class DrafterProcess:
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
