"""The tensor-parallel group: rank 0 (the engine) and the ranks that run the other shards.

torch.distributed carries everything (gloo on CPU, NCCL on CUDA). Rank 0 owns scheduling,
sampling and verification; before each forward it broadcasts the prepared inputs (token ids,
positions, attention metadata), and every rank runs its shard, the shards meeting in one
all-reduce after each attention and each MLP. Logits are computed on rank 0 (the LM head is
replicated), so nothing else ever comes back.

Two ways in:

* ``TensorParallelGroup.launch``: the engine starts its own worker ranks on this host (fresh
  interpreters, ``python -m specfork.parallel.worker``), as vLLM's workers; rendezvous on a
  TCP store on 127.0.0.1 at a free port;
* ``TensorParallelGroup.join``: the process is one rank of a group started by ``torchrun``
  (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), for several hosts. Ranks other
  than 0 serve forwards (``serve_forwards``) and leave when rank 0 closes.

Failures end the run: a rank that dies or stops answering for ``timeout`` seconds makes the next
collective fail on rank 0, which raises :class:`RankFailure` naming the rank, and the engine's
step re-raises it instead of failing requests one by one. Worker processes never outlive the
group: rank 0 kills them on close (or at exit), and a worker whose peer connection breaks exits.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from specfork.errors import EngineFailure, ModelLoadError
from specfork.parallel.shard import TensorShard

logger = logging.getLogger(__name__)

LAUNCH_KEY = "specfork/launch"
ALIVE_KEY = "specfork/alive/{}"


class RankFailure(EngineFailure):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


@dataclass(frozen=True)
class ShardLaunch:
    """What every rank needs to build its shard and its part of the KV cache (the same for all)."""

    model: str
    device: str
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
    """The operations ranks share, with the time spent in all-reduce (for the benchmark)."""

    rank: int
    size: int
    reduce_seconds: float = 0.0
    reduce_calls: int = 0
    failure: str | None = field(default=None)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's ``partial``: the parts are gathered and added in
        rank order. That is deterministic whatever rides along (gloo's ring all-reduce splits a
        tensor into chunks by its size, so a row's sum would depend on the batch), and on CPU it
        is faster too: one exchange instead of a ring's several (gloo on this 2-core machine:
        0.5-0.75 ms per all-gather of 576-3456 floats against 1.2-1.8 ms per all-reduce)."""
        start = time.perf_counter()
        parts = [torch.empty_like(partial) for _ in range(self.size)]
        dist.all_gather(parts, partial.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        self.reduce_seconds += time.perf_counter() - start
        self.reduce_calls += 1
        return total

    def shard(self) -> TensorShard:
        return TensorShard(self.rank, self.size, self.all_reduce)

    @property
    def mean_reduce_ms(self) -> float:
        return 1000 * self.reduce_seconds / max(self.reduce_calls, 1)


class TensorParallelGroup:
    """Rank 0's handle on the group."""

    def __init__(self, collectives: Collectives, workers: list[subprocess.Popen], timeout_s: float) -> None:
        self.collectives = collectives
        self.workers = workers  # local worker processes (empty when joined through torchrun)
        self.timeout_s = timeout_s
        self._serving = False  # every rank built its shard and waits for forwards
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, list(workers))

    @property
    def size(self) -> int:
        return self.collectives.size

    @property
    def shard(self) -> TensorShard:
        """Rank 0's shard: its all-reduce turns a broken group into :class:`RankFailure`."""
        return TensorShard(0, self.size, self.all_reduce)

    # ---- start-up ---------------------------------------------------------------------------

    @classmethod
    def launch(cls, size: int, launch: ShardLaunch, timeout_s: float) -> TensorParallelGroup:
        """Start ranks 1..size-1 on this host and join them as rank 0."""
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        store.set(LAUNCH_KEY, pickle.dumps(launch))
        workers = [
            subprocess.Popen([sys.executable, "-m", "specfork.parallel.worker", "127.0.0.1", str(store.port),
                              str(rank), str(size), str(timeout_s)])
            for rank in range(1, size)
        ]
        group = cls(Collectives(0, size), workers, timeout_s)
        try:
            group._await_workers(store, timeout_s)
            dist.init_process_group(_backend(launch.device), store=store, rank=0, world_size=size,
                                    timeout=timedelta(seconds=timeout_s))
        except BaseException:
            group.close()
            raise
        return group

    @classmethod
    def join(cls, size: int, launch: ShardLaunch, timeout_s: float) -> TensorParallelGroup | None:
        """Join a group started by torchrun (torch.distributed's env:// rendezvous). Rank 0 gets
        the group; any other rank serves forwards until rank 0 closes and then gets None."""
        try:
            dist.init_process_group(_backend(launch.device), timeout=timedelta(seconds=timeout_s))
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"cannot join the torchrun group ({str(e).splitlines()[0][:200]}); start with "
                                 "torchrun --nproc-per-node N, or use --distributed-launch local") from None
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != size:
            dist.destroy_process_group()
            raise ModelLoadError(f"torchrun started {world} processes but tensor_parallel_size is {size}")
        if rank == 0:
            return cls(Collectives(0, size), [], timeout_s)
        from specfork.parallel.worker import run_rank

        device = "cpu"
        if launch.device.startswith("cuda"):
            device = f"cuda:{rank % torch.cuda.device_count()}"
        try:
            run_rank(launch, rank, size, device)
        finally:
            dist.destroy_process_group()
        return None

    def _await_workers(self, store, timeout_s: float) -> None:
        """Wait until every worker reached the store, failing fast if one exits before it did."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(1, self.size))
        while pending:
            pending = {r for r in pending if not store.check([ALIVE_KEY.format(r)])}
            for rank in pending:
                code = self.workers[rank - 1].poll()
                if code is not None:
                    raise RankFailure(f"tensor-parallel rank {rank} exited with code {code} while starting")
            if pending and time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks {sorted(pending)} did not start within {timeout_s:.0f} s")
            time.sleep(0.02)

    def check_loaded(self, error: str | None) -> None:
        """Every rank reports whether it built its shard (``error``: rank 0's own failure, which
        its caller raises); another rank's failure is raised here."""
        reports = self._guard(lambda: gather_reports(error, self.size))
        failed = [(r, e) for r, e in enumerate(reports) if e is not None and r != 0]
        if failed:
            rank, message = failed[0]
            raise ModelLoadError(f"tensor-parallel rank {rank} could not load its shard: {message}")
        self._serving = True

    # ---- steps ------------------------------------------------------------------------------

    def broadcast_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """Send one forward's inputs to the other ranks (they run it as rank 0 does)."""
        self._guard(lambda: dist.broadcast_object_list([("forward", ids, positions, meta)], src=0))

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return self._guard(lambda: self.collectives.all_reduce(partial))

    def _guard(self, operation):
        if self.collectives.failure is not None:
            raise RankFailure(self.collectives.failure)
        try:
            return operation()
        except RuntimeError as e:  # gloo/NCCL: a peer closed its connection or timed out
            self.collectives.failure = self._diagnose(e)
            self.close()
            raise RankFailure(self.collectives.failure) from None

    def _diagnose(self, error: Exception) -> str:
        time.sleep(0.2)  # a rank that died takes a moment to be reaped
        dead = [(rank, w.poll()) for rank, w in enumerate(self.workers, start=1) if w.poll() is not None]
        if dead:
            rank, code = dead[0]
            return f"tensor-parallel rank {rank} (pid {self.workers[rank - 1].pid}) exited with code {code}; the engine stopped"
        if "timed out" in str(error).lower():
            return f"a tensor-parallel rank did not answer within {self.timeout_s:g} s (--dist-timeout); the engine stopped"
        return f"tensor-parallel collective failed ({str(error).splitlines()[0][:200]}); the engine stopped"

    def close(self) -> None:
        """Tell the other ranks to leave, then make sure they did (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._serving and self.collectives.failure is None and dist.is_initialized():
            try:
                dist.broadcast_object_list([("exit",)], src=0)
            except RuntimeError:
                pass
        if self.collectives.failure is None:  # a clean exit takes a moment; a broken group gets none
            for worker in self.workers:
                try:
                    worker.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        _kill_all(self.workers)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_group(size: int, launch: ShardLaunch, timeout_s: float, how: str) -> TensorParallelGroup | None:
    """``how`` "local": start ranks 1..size-1 here; "torchrun": join the group torchrun started
    (None on ranks other than 0, once rank 0 closed it)."""
    if how == "torchrun":
        return TensorParallelGroup.join(size, launch, timeout_s)
    return TensorParallelGroup.launch(size, launch, timeout_s)


def serve_forwards(runner, collectives: Collectives) -> None:
    """A rank other than 0: run every forward rank 0 broadcasts until it says exit."""
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            kind = message[0][0]
            if kind == "exit":
                return
            _, ids, positions, meta = message[0]
            runner.model(ids, positions, runner.kv_caches, meta)


def gather_reports(error: str | None, size: int) -> list[str | None]:
    reports: list[str | None] = [None] * size
    dist.all_gather_object(reports, error)
    return reports


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _kill_all(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
    for worker in workers:
        try:
            worker.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("tensor-parallel worker %d did not exit after SIGKILL", worker.pid)
