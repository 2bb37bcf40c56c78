"""The torch.distributed world an engine runs in: rank 0 (the engine) and the ranks it needs.

Ranks 0..model_ranks-1 hold the model's tensor-parallel shards (parallel/group.py); ranks after
them serve other roles (SSD's drafter: speculative/ssd/worker.py). Every rank other than 0 runs
one :class:`RankRole`, a function named by its import path, so this module knows nothing of
what the roles do. Transport is torch.distributed itself: gloo on CPU, NCCL on CUDA.

Two ways in (``Config.distributed_launch``):

* ``local``: rank 0 starts the other ranks on this host (fresh interpreters running
  ``python -m specfork.parallel.worker``, as vLLM starts its workers) and meets them on a TCP
  store at a free port of 127.0.0.1. A rank that exits before it joins fails the start at once.
* ``torchrun``: every rank was started by torchrun (any number of hosts) with the same command;
  each computes the same plan, and ranks other than 0 run their role, then their process ends.

When the model's shards share the world with other ranks, they get their own subgroup, so their
collectives never wait on (or break with) a drafter. No rank outlives the world: rank 0 kills
the processes it started when it closes (or at exit), and each ends itself once its parent is
gone (a thread watching the parent pid).
"""

from __future__ import annotations

import importlib
import logging
import pickle
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specfork.errors import EngineFailure, ModelLoadError

logger = logging.getLogger(__name__)

PLAN_KEY = "specfork/plan"
ALIVE_KEY = "specfork/alive/{}"
# What a rank may wait for its next message while the engine is idle (a server between requests,
# a drafter between rounds): a week, where ``--dist-timeout`` bounds waits on a rank at work.
IDLE_TIMEOUT = timedelta(days=7)
START_TIMEOUT_S = 120.0  # at least this long for ranks to start (import torch) and load their part


class RankFailure(EngineFailure):
    """A rank the engine needs died or stopped answering: the engine cannot go on."""


@dataclass(frozen=True)
class RankRole:
    """What one rank other than 0 runs: ``function`` ("package.module:name"), called as
    ``function(payload, world)`` once the world is up; the rank's process ends when it returns."""

    function: str
    payload: object = None


@dataclass(frozen=True)
class WorldPlan:
    roles: tuple[RankRole, ...]  # of ranks 1..size-1
    model_ranks: int  # ranks 0..model_ranks-1 hold the model's shards
    device: str  # the engine's device: gloo on CPU, NCCL on CUDA
    timeout_s: float  # what a rank at work may wait for another (--dist-timeout)

    @property
    def size(self) -> int:
        return len(self.roles) + 1

    @property
    def start_timeout(self) -> timedelta:
        """What start-up (interpreters, loading) may take: also the default group's timeout."""
        return timedelta(seconds=max(self.timeout_s, START_TIMEOUT_S))

    @property
    def backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def device_of(self, rank: int) -> str:
        """The device a rank runs on (on CUDA: one GPU per rank of a host)."""
        if not self.device.startswith("cuda"):
            return "cpu"
        return f"cuda:{rank % torch.cuda.device_count()}"


class World:
    def __init__(self, plan: WorldPlan, rank: int, processes: dict[int, subprocess.Popen]) -> None:
        self.plan = plan
        self.rank = rank
        self.processes = processes  # rank -> the local process rank 0 started (none under torchrun)
        self._closed = False
        self._finalizer = weakref.finalize(self, kill_processes, list(processes.values()))
        # Every rank creates every subgroup, in the same order (torch.distributed's rule).
        shards = list(range(plan.model_ranks))
        self.model_group = self.model_start_group = self.model_idle_group = None
        if plan.model_ranks > 1:
            # The shards' sums, bounded by --dist-timeout.
            self.model_group = dist.new_group(shards, timeout=timedelta(seconds=plan.timeout_s))
            # Their start-up reports, which wait for the slowest to load.
            self.model_start_group = dist.new_group(shards, timeout=plan.start_timeout)
            # The forwards' inputs, which they wait for while the engine is idle (pickles: gloo).
            self.model_idle_group = dist.new_group(shards, timeout=IDLE_TIMEOUT, backend="gloo")
        # Messages between rank 0 and the other roles: pickles in CPU tensors, so gloo even under
        # NCCL; a receive is always posted (parallel/connection.py), hence the idle timeout.
        self.message_group = None
        if plan.size > plan.model_ranks:
            self.message_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    @property
    def size(self) -> int:
        return self.plan.size

    # ---- start-up ---------------------------------------------------------------------------

    @classmethod
    def start(cls, plan: WorldPlan, how: str) -> World | None:
        """Rank 0's world; under torchrun, a rank other than 0 runs its role here and gets None."""
        return cls._join_torchrun(plan) if how == "torchrun" else cls._launch(plan)

    @classmethod
    def _launch(cls, plan: WorldPlan) -> World:
        timeout = plan.start_timeout
        if plan.device.startswith("cuda") and torch.cuda.device_count() < plan.size:
            raise ModelLoadError(f"{plan.size} ranks on this host need {plan.size} GPUs; "
                                 f"{torch.cuda.device_count()} are visible")
        store = dist.TCPStore("127.0.0.1", 0, plan.size, is_master=True, timeout=timeout, wait_for_workers=False)
        store.set(PLAN_KEY, pickle.dumps(plan))
        processes = {
            rank: subprocess.Popen([sys.executable, "-m", "specfork.parallel.worker", "127.0.0.1", str(store.port),
                                    str(rank), str(plan.size), str(timeout.total_seconds())])
            for rank in range(1, plan.size)
        }
        try:
            _await_ranks(store, processes, timeout.total_seconds())
            dist.init_process_group(plan.backend, store=store, rank=0, world_size=plan.size, timeout=timeout)
            return cls(plan, 0, processes)
        except BaseException:
            kill_processes(list(processes.values()))
            if dist.is_initialized():
                dist.destroy_process_group()
            raise

    @classmethod
    def _join_torchrun(cls, plan: WorldPlan) -> World | None:
        try:
            dist.init_process_group(plan.backend, timeout=plan.start_timeout)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"cannot join the torchrun group ({brief(e)}); start with "
                                 "torchrun --nproc-per-node N, or use --distributed-launch local") from None
        if dist.get_world_size() != plan.size:
            size = dist.get_world_size()
            dist.destroy_process_group()
            raise ModelLoadError(f"torchrun started {size} processes but this configuration needs {plan.size} "
                                 f"({plan.model_ranks} for the model, {plan.size - plan.model_ranks} more)")
        world = cls(plan, dist.get_rank(), {})
        if world.rank == 0:
            return world
        try:
            world.run_role()
        except RuntimeError as e:  # rank 0 died or the group broke: one line, not a traceback
            raise RankFailure(f"rank {world.rank} stopped: the group broke ({brief(e)})") from None
        finally:
            world.close()
        return None

    def run_role(self) -> None:
        """This rank's role (ranks other than 0)."""
        role = self.plan.roles[self.rank - 1]
        module, name = role.function.split(":")
        getattr(importlib.import_module(module), name)(role.payload, self)

    # ---- failures ---------------------------------------------------------------------------

    def describe_failure(self, error: Exception, ranks: range, what: str) -> str:
        """Why an operation with ``ranks`` failed: a local rank that exited, or a timeout."""
        time.sleep(0.2)  # a rank that died takes a moment to be reaped
        for rank in ranks:
            process = self.processes.get(rank)
            if process is not None and process.poll() is not None:
                return f"{what} rank {rank} (pid {process.pid}) exited with code {process.returncode}"
        if brief(error) == "timed out":
            return f"a {what} rank did not answer within {self.plan.timeout_s:g} s (--dist-timeout)"
        return f"{what} collective failed ({brief(error)})"

    def close(self) -> None:
        """Wait briefly for the ranks this process started, kill what is left, leave the group."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 5
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        kill_processes(list(self.processes.values()))
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self) -> None:
        """Rank 0 after a failure: no grace period for the ranks it started."""
        kill_processes(list(self.processes.values()))


def _await_ranks(store, processes: dict[int, subprocess.Popen], timeout_s: float) -> None:
    """Wait until every started rank reached the store, failing fast if one exits before it did."""
    deadline = time.monotonic() + timeout_s
    pending = set(processes)
    while pending:
        pending = {r for r in pending if not store.check([ALIVE_KEY.format(r)])}
        for rank in sorted(pending):
            code = processes[rank].poll()
            if code is not None:
                raise RankFailure(f"rank {rank} exited with code {code} while starting")
        if pending and time.monotonic() > deadline:
            raise RankFailure(f"ranks {sorted(pending)} did not start within {timeout_s:.0f} s")
        time.sleep(0.02)


def brief(error: BaseException) -> str:
    """A torch.distributed error in a few words (its messages run to several lines of C++ context)."""
    text = str(error)
    if "closed by peer" in text.lower():
        return "connection closed"
    if "timed out" in text.lower():
        return "timed out"
    return text.splitlines()[0][:200] if text else type(error).__name__


def kill_processes(processes: list[subprocess.Popen]) -> None:
    """SIGKILL whatever still runs, then reap it all."""
    for process in processes:
        if process.poll() is None:
            process.kill()
    for process in processes:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("rank process %d did not exit after SIGKILL", process.pid)
