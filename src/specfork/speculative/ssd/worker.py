"""The drafter process: loads the draft on its own cores/device and serves speculation requests
over a pipe, pre-drafting between requests. Started and stopped by :class:`SSDProposer`.

Messages from the target (in order, one at a time):

* ``("spec", requests, released_ids)``: forget ``released_ids``, answer ``requests`` at once
  with ``("spec", replies, stats)``, then pre-draft the next round;
* ``("exit",)``: leave.

The first message is the :class:`DrafterLaunch`; the reply ``("ready", info)`` or
``("error", message)``. The process also leaves when the connection closes (the target died)
or on Ctrl-C.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from specfork.speculative.ssd.drafter import DrafterCore, DrafterSettings, SpecReply

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DrafterLaunch:
    draft: str
    settings: DrafterSettings
    device: str
    dtype: str
    threads: int
    cores: tuple[int, ...] | None
    max_positions: int
    seed: int
    load_options: dict


@dataclass(slots=True)
class WireReply:
    """A reply as it crosses the pipe (numpy arrays pickle without shared-memory handles)."""

    seq_id: int
    source: str
    tokens: list[int]
    probs: np.ndarray | None

    @classmethod
    def of(cls, reply: SpecReply) -> "WireReply":
        probs = None if reply.probs is None else reply.probs.detach().float().cpu().numpy()
        return cls(reply.seq_id, reply.source, reply.tokens, probs)


def drafter_main(conn) -> None:
    try:
        launch: DrafterLaunch = conn.recv()
        if launch.cores:
            os.sched_setaffinity(0, launch.cores)
        torch.set_num_threads(launch.threads)
        from specfork.loading import load_model

        device = torch.device(launch.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        loaded = load_model(
            launch.draft, device=device, dtype=getattr(torch, launch.dtype), max_positions=launch.max_positions,
            with_tokenizer=False, **launch.load_options,  # the drafter sees token ids only
        )
        core = DrafterCore(loaded.model, launch.settings, device, seed=launch.seed)
        conn.send(("ready", {"pid": os.getpid(), "threads": torch.get_num_threads()}))
    except KeyboardInterrupt:
        return
    except Exception as e:  # reported to the target, which falls back
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "exit":
                return
            if msg[0] == "spec":
                _, requests, released = msg
                for seq_id in released:
                    core.release(seq_id)
                replies = core.speculate(requests)
                conn.send(("spec", [WireReply.of(r) for r in replies], dict(core.stats)))
                core.prepare_next()
    except KeyboardInterrupt:
        return
    except (BrokenPipeError, ConnectionResetError):
        return


if __name__ == "__main__":
    import sys
    from multiprocessing.connection import Connection

    # Run the module's importable twin, so pickled classes are named specfork.speculative.ssd.worker.*.
    from specfork.speculative.ssd import worker

    worker.drafter_main(Connection(int(sys.argv[1])))
