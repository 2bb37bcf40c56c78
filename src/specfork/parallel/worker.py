"""A rank other than 0 started by the engine on this host: ``python -m specfork.parallel.worker
HOST PORT RANK SIZE TIMEOUT`` joins the world (parallel/world.py) and runs its role (a
tensor-parallel shard: engine/shard_role.py; SSD's drafter: speculative/ssd/worker.py).

Any failure ends the process: its peers see the connection close and stop with a clear error.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from specfork.parallel.world import ALIVE_KEY, PLAN_KEY, World, WorldPlan, brief

logger = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """End this process when the process that started it is gone, however it went (a thread
    watching the parent pid: PR_SET_PDEATHSIG would fire when the parent's *thread* exits)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    host, port, rank, size, timeout_s = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), float(argv[4])
    _die_with_parent()
    timeout = timedelta(seconds=timeout_s)  # the world's start-up timeout
    try:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        plan: WorldPlan = pickle.loads(store.get(PLAN_KEY))
        store.set(ALIVE_KEY.format(rank), "1")
        if plan.backend == "nccl":  # NCCL's object collectives use the current device
            torch.cuda.set_device(plan.device_of(rank))
        dist.init_process_group(plan.backend, store=store, rank=rank, world_size=size, timeout=timeout)
        World(plan, rank, {}).run_role()
    except KeyboardInterrupt:
        return 1
    except RuntimeError as e:  # the world broke (rank 0 died or closed): nothing to report to
        logger.error("rank %d stopped: %s", rank, brief(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
