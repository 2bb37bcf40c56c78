"""A rank other than 0 started by the engine on this host: ``python -m specfork.parallel.worker
HOST PORT RANK SIZE TIMEOUT`` joins the world (parallel/world.py) and runs its role; and the
role of a tensor-parallel shard, :func:`run_shard`.

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

from specfork.parallel.group import Collectives, ShardLaunch, serve_forwards
from specfork.parallel.world import ALIVE_KEY, PLAN_KEY, World, WorldPlan

logger = logging.getLogger(__name__)


def run_shard(launch: ShardLaunch, world: World) -> None:
    """Build this rank's shard and its part of the KV cache, report to rank 0, serve forwards."""
    from specfork.engine.model_runner import ModelRunner
    from specfork.loading import load_model

    torch.set_num_threads(launch.threads)
    collectives = Collectives(world.rank, world.plan.model_ranks, world.model_group)
    device = torch.device(world.plan.device_of(world.rank))
    runner, error = None, None
    try:
        loaded = load_model(launch.model, device=device, dtype=getattr(torch, launch.dtype),
                            max_positions=launch.max_positions, with_tokenizer=False, shard=collectives.shard(),
                            **launch.load_options)
        runner = ModelRunner(loaded.model, num_blocks=launch.num_blocks, block_size=launch.block_size,
                             device=device, deterministic=launch.deterministic,
                             kv_dtype=getattr(torch, launch.kv_dtype) if launch.kv_dtype else None)
    except Exception as e:  # reported to rank 0, which raises it
        error = f"{type(e).__name__}: {e}"
    if any(report is not None for report in collectives.gather_reports(error)):
        return
    serve_forwards(runner, collectives)


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
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        plan: WorldPlan = pickle.loads(store.get(PLAN_KEY))
        store.set(ALIVE_KEY.format(rank), "1")
        dist.init_process_group(plan.backend, store=store, rank=rank, world_size=size, timeout=timeout)
        World(plan, rank, {}).run_role()
    except KeyboardInterrupt:
        return 1
    except RuntimeError as e:  # the world broke (rank 0 died or closed): nothing to report to
        logger.error("rank %d stopped: %s", rank, str(e).splitlines()[0][:200])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
