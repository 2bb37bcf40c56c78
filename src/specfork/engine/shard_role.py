"""The role of tensor-parallel ranks 1..N-1 (parallel/world.py runs it by its import path): build
this rank's shard of the model and its part of the KV cache, report to rank 0, then run every
forward rank 0 sends (parallel/group.py) until it says exit."""

from __future__ import annotations

import torch

from specfork.engine.model_runner import ModelRunner
from specfork.loading import load_model
from specfork.parallel.group import Collectives, ShardLaunch, serve_forwards
from specfork.parallel.world import World

SHARD_ROLE = "specfork.engine.shard_role:run_shard"


def run_shard(launch: ShardLaunch, world: World) -> None:
    torch.set_num_threads(launch.threads)
    collectives = Collectives.of(world)
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
