"""The drafter process: loads the draft on its own cores/device and serves speculation requests
over a pipe, pre-drafting between requests. Started and stopped by :class:`SSDProposer`.

Messages from the target (in order, one at a time):

* ``("spec", requests, released_ids)``: forget ``released_ids``, answer ``requests`` at once
  with ``("spec", replies, stats)``, then pre-draft the next round;
* ``("exit",)``: leave.

The first message is the :class:`DrafterLaunch`; the reply ``("ready", info)`` or
``("error", message)``. The process also leaves when the connection closes (the target died).
It runs in its own session, so a terminal's Ctrl-C reaches the target only, which stops it.
"""

from __future__ import annotations

import logging
import os

import torch

from specfork.speculative.draft_loading import load_drafter
from specfork.speculative.ssd.cores import pin_process
from specfork.speculative.ssd.drafter import DrafterCore
from specfork.speculative.ssd.messages import DrafterLaunch, WireReply

logger = logging.getLogger(__name__)

DRAFTER_ROLE = "specfork.speculative.ssd.worker:serve_rank"  # the drafter as a rank (parallel/world.py)


def drafter_main(conn) -> None:
    try:
        launch: DrafterLaunch = conn.recv()
    except (EOFError, OSError, KeyboardInterrupt):  # the target went away before launching it
        return
    try:
        pin_process(launch.cores or tuple(os.sched_getaffinity(0)), launch.threads)
        device = torch.device(launch.device)
        if device.type == "cuda":
            if device.index is None:  # "cuda": the process's current GPU, named so that set_device takes it
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        drafter = load_drafter(launch.draft, device)  # token ids only: no tokenizer
        core = DrafterCore(drafter, launch.settings, device, seed=launch.seed)
        conn.send(("ready", {"pid": os.getpid(), "threads": torch.get_num_threads()}))
    except KeyboardInterrupt:
        return
    except Exception as e:  # reported to the target, which falls back
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:  # the target is gone too
            pass
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


def serve_rank(_payload, world) -> None:
    """The drafter as a rank of the torch.distributed world (role of parallel/world.py): the same
    loop, its messages to and from rank 0 carried by torch.distributed."""
    from specfork.parallel.connection import RankConnection

    conn = RankConnection(0, world.plan.timeout_s, world.message_group)
    try:
        drafter_main(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    import sys
    from multiprocessing.connection import Connection

    # Run the module's importable twin, so pickled classes are named specfork.speculative.ssd.worker.*.
    from specfork.speculative.ssd import worker

    worker.drafter_main(Connection(int(sys.argv[1])))
