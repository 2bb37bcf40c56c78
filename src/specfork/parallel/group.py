"""Tensor parallelism: the model's shards on ranks 0..N-1 of the world (parallel/world.py).

Rank 0 owns scheduling, sampling and verification. Before each forward it sends every shard the
prepared inputs (token ids, positions, attention metadata: one pickled frame each,
parallel/connection.py); every rank runs its shard, the shards meeting in one all-reduce after
each attention and each MLP. A shard waits for its next frame on a group with the world's idle
timeout (an engine may sit idle for hours); rank 0's sends and the sums are bounded by
``--dist-timeout``. Logits are computed on rank
0 (the LM head is replicated), so nothing else ever comes back.

A rank that dies or stops answering makes the next collective fail on rank 0, which raises
:class:`RankFailure` naming the rank; the engine's step re-raises it (the run ends) instead of
failing requests one by one.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, fields, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from specfork.errors import ModelLoadError
from specfork.models.tensor_parallel import TensorShard
from specfork.parallel.connection import CLOSE_TIMEOUT_S, recv_frame, send_frame
from specfork.parallel.world import RankFailure, World

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardLaunch:
    """What every rank needs to build its shard and its part of the KV cache (the same for all)."""

    model: str
    dtype: str
    max_positions: int | None
    load_options: dict
    num_blocks: int
    block_size: int
    kv_dtype: str | None
    deterministic: bool
    threads: int


@dataclass
class Collectives:
    """What the shards do together, with the time spent in all-reduce (for the benchmark)."""

    rank: int
    size: int
    group: object  # the world's model group for the sums
    start_group: object  # the same ranks, for the start-up reports
    idle_group: object  # the same ranks, for the inputs a shard waits for while the engine is idle
    timeout: timedelta  # what rank 0 waits for a shard to take its inputs
    reduce_seconds: float = 0.0
    reduce_calls: int = 0
    forwards: int = 0  # forwards rank 0 sent out

    @classmethod
    def of(cls, world: World) -> Collectives:
        return cls(world.rank, world.plan.model_ranks, world.model_group, world.model_start_group,
                   world.model_idle_group, timedelta(seconds=world.plan.timeout_s))

    def send_all(self, message, timeout: timedelta | None = None) -> None:
        """Rank 0: the same message to every shard, each waiting at most ``timeout`` (default:
        --dist-timeout) to be taken."""
        data = pickle.dumps(message)
        for rank in range(1, self.size):
            send_frame(data, rank, self.idle_group, timeout or self.timeout)

    def reset(self) -> None:
        """Zero the counters (a benchmark's timed passes start here)."""
        self.reduce_seconds, self.reduce_calls, self.forwards = 0.0, 0, 0

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's ``partial``: the parts are gathered and added in
        rank order. That is deterministic whatever rides along (gloo's ring all-reduce splits a
        tensor into chunks by its size, so a row's sum would depend on the batch), and on CPU it
        is faster too: one exchange instead of a ring's several (gloo on this 2-core machine:
        0.5-0.75 ms per all-gather of 576-3456 floats against 1.2-1.8 ms per all-reduce)."""
        start = time.perf_counter()
        parts = [torch.empty_like(partial) for _ in range(self.size)]
        dist.all_gather(parts, partial.contiguous(), group=self.group)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        self.reduce_seconds += time.perf_counter() - start
        self.reduce_calls += 1
        return total

    def shard(self) -> TensorShard:
        return TensorShard(self.rank, self.size, self.all_reduce)

    def gather_reports(self, error: str | None) -> list[str | None]:
        """Every shard's start-up report (None: it built its shard)."""
        reports: list[str | None] = [None] * self.size
        dist.all_gather_object(reports, error, group=self.start_group)
        return reports

    @property
    def mean_reduce_ms(self) -> float:
        return 1000 * self.reduce_seconds / max(self.reduce_calls, 1)


class TensorParallelGroup:
    """Rank 0's handle on the shards."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.collectives = Collectives.of(world)
        self.failure: str | None = None
        self._serving = False  # every rank built its shard and waits for forwards
        self._closed = False

    @property
    def size(self) -> int:
        return self.collectives.size

    @property
    def workers(self) -> list:
        """The local processes of ranks 1..size-1 (empty under torchrun)."""
        return [self.world.processes[r] for r in range(1, self.size) if r in self.world.processes]

    @property
    def shard(self) -> TensorShard:
        """Rank 0's shard: its all-reduce turns a broken group into :class:`RankFailure`."""
        return TensorShard(0, self.size, self.all_reduce)

    def check_loaded(self, error: str | None) -> None:
        """Every rank reports whether it built its shard (``error``: rank 0's own failure, which
        its caller raises); another rank's failure is raised here."""
        reports = self._guard(lambda: self.collectives.gather_reports(error))
        failed = [(r, e) for r, e in enumerate(reports) if e is not None and r != 0]
        if failed:
            rank, message = failed[0]
            raise ModelLoadError(f"tensor-parallel rank {rank} could not load its shard: {message}")
        self._serving = error is None

    def send_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """Send one forward's inputs to the other ranks (they run it as rank 0 does). They travel
        as CPU tensors: each rank puts them on its own device."""
        self.collectives.forwards += 1
        inputs = _on(torch.device("cpu"), (ids, positions, meta))
        self._guard(lambda: self.collectives.send_all(("forward", *inputs)))

    def fail(self, reason: str) -> None:
        """Rank 0 could not finish a forward the shards started (an error of its own, an
        interrupt): they are stuck inside it, so the group cannot go on."""
        if self.failure is None:
            self.failure = f"{reason}; the tensor-parallel ranks were stopped"
            self.world.kill()

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self._guard(lambda: self.collectives.all_reduce(partial))

    def _guard(self, operation):
        if self.failure is not None:
            raise RankFailure(self.failure)
        try:
            return operation()
        except RuntimeError as e:  # gloo/NCCL: a peer closed its connection or timed out
            self.failure = self.world.describe_failure(e, range(1, self.size), "tensor-parallel") + \
                "; the engine stopped"
            self.world.kill()
            raise RankFailure(self.failure) from None

    def close(self) -> None:
        """Tell the other shards to leave (idempotent); the world then waits for them."""
        if self._closed:
            return
        self._closed = True
        if self._serving and self.failure is None:
            try:  # a hung shard must not hold the engine's exit up: the world kills it
                self.collectives.send_all(("exit",), timedelta(seconds=CLOSE_TIMEOUT_S))
            except RuntimeError:
                pass


def serve_forwards(runner, collectives: Collectives) -> None:
    """A rank other than 0: run every forward rank 0 sends until it says exit."""
    with torch.inference_mode():
        while True:
            frame = recv_frame(0, collectives.idle_group)
            message = ("exit",) if frame is None else pickle.loads(frame)
            if message[0] == "exit":
                return
            ids, positions, meta = _on(runner.device, message[1:])
            runner.model(ids, positions, runner.kv_caches, meta)


def _on(device: torch.device, inputs: tuple) -> tuple:
    """A forward's inputs on this rank's device (on CUDA, rank 0's tensors arrive on rank 0's GPU)."""
    ids, positions, meta = inputs
    if ids.device == device:
        return ids, positions, meta
    moved = {f.name: getattr(meta, f.name).to(device) for f in fields(meta)
             if isinstance(getattr(meta, f.name), torch.Tensor)}
    return ids.to(device), positions.to(device), replace(meta, **moved)
