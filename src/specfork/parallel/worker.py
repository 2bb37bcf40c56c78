"""A tensor-parallel rank other than 0: builds its shard and its part of the KV cache, then runs
the forwards rank 0 broadcasts (parallel/group.py) until told to leave.

Started by :meth:`TensorParallelGroup.launch` as ``python -m specfork.parallel.worker HOST PORT
RANK SIZE TIMEOUT`` (the rest of what it needs is read from the group's store), or entered
through :func:`run_rank` by a rank of a torchrun group. Any failure ends the process: its peers
see the connection close and stop with a clear error.
"""

from __future__ import annotations

import logging
import pickle
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from specfork.parallel.group import (
    ALIVE_KEY,
    LAUNCH_KEY,
    Collectives,
    ShardLaunch,
    gather_reports,
    serve_forwards,
)

logger = logging.getLogger(__name__)


def run_rank(launch: ShardLaunch, rank: int, size: int, device: str) -> None:
    """Build this rank's shard, report to the group, serve forwards. The process group is up."""
    from specfork.engine.model_runner import ModelRunner
    from specfork.loading import load_model

    torch.set_num_threads(launch.threads)
    collectives = Collectives(rank, size)
    runner, error = None, None
    try:
        loaded = load_model(launch.model, device=torch.device(device), dtype=getattr(torch, launch.dtype),
                            max_positions=launch.max_positions, with_tokenizer=False, shard=collectives.shard(),
                            **launch.load_options)
        runner = ModelRunner(loaded.model, num_blocks=launch.num_blocks, block_size=launch.block_size,
                             device=torch.device(device), deterministic=launch.deterministic,
                             kv_dtype=getattr(torch, launch.kv_dtype) if launch.kv_dtype else None)
    except Exception as e:  # reported to rank 0, which raises it
        error = f"{type(e).__name__}: {e}"
    if any(report is not None for report in gather_reports(error, size)):
        return
    serve_forwards(runner, collectives)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the process that started it dies, however it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    host, port, rank, size, timeout_s = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), float(argv[4])
    _die_with_parent()
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        launch: ShardLaunch = pickle.loads(store.get(LAUNCH_KEY))
        store.set(ALIVE_KEY.format(rank), "1")
        device = f"cuda:{rank}" if launch.device.startswith("cuda") else "cpu"
        dist.init_process_group("nccl" if device != "cpu" else "gloo", store=store, rank=rank, world_size=size,
                                timeout=timeout)
        run_rank(launch, rank, size, device)
    except KeyboardInterrupt:
        return 1
    except RuntimeError as e:  # the group broke (rank 0 died or closed): nothing to report to
        logger.error("tensor-parallel rank %d stopped: %s", rank, str(e).splitlines()[0][:200])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
