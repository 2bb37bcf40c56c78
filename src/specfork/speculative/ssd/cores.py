"""CPU placement of SSD's two processes, in one place: the target and the drafter each get
their own cores (by default the available cores split in halves), so neither's OpenMP threads
spin on the other's."""

from __future__ import annotations

import os
import weakref

import torch

from specfork.config import Config, parse_cores
from specfork.errors import SpecforkError


def split_cores(config: Config, both_on_cpu: bool = True) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """Disjoint core sets for the target and the drafter: as configured, else the available
    cores split in halves (None, None on a machine with a single core: they share it). Where
    both run on the CPU, a side given every core leaves the other none: refused. (Where one runs
    on a GPU, the other may take every core.)"""
    available = tuple(sorted(os.sched_getaffinity(0)))
    target = parse_cores(config.target_cores, "target_cores") if config.target_cores else None
    drafter = parse_cores(config.draft_cores, "draft_cores") if config.draft_cores else None
    for name, cores in (("target_cores", target), ("draft_cores", drafter)):
        if cores is not None and not set(cores) <= set(available):
            raise SpecforkError(f"{name} {list(cores)} are not all available to this process (available: {list(available)})")
    if target is None and drafter is None:
        if len(available) < 2:
            return None, None
        half = len(available) // 2
        return available[:half], available[half:]
    if target is None:
        target = tuple(c for c in available if c not in drafter)
    if drafter is None:
        drafter = tuple(c for c in available if c not in target)
    for name, other, cores in (("target_cores", "draft_cores", target), ("draft_cores", "target_cores", drafter)):
        if not cores and both_on_cpu:  # both processes on the same cores, their threads spinning on each other's
            raise SpecforkError(f"--{other.replace('_', '-')} takes every core available ({list(available)}), "
                                f"leaving none for --{name.replace('_', '-')}: give each its own")
    return target or available, drafter or available


def core_sharing_warning(target: tuple[int, ...] | None, available: int) -> str | None:
    """What to tell a user whose CPU target gives cores up to the drafter process (SSD on a small
    machine): the target then decodes on fewer cores than SD or AR would give it, which can cost
    more than the drafting SSD hides. None when the target keeps at least 4 cores."""
    if target is None or len(target) >= 4:
        return None
    return (f"SSD on this {available}-core machine: the drafter process takes {available - len(target)} of the "
            f"{available} cores, so the target verifies on {len(target)} (SD and AR use all {available}); with "
            "a target whose decode step is limited by compute, SSD can be slower than SD here. It pays where the "
            "drafter has its own cores or GPU (specfork bench reports SSD's cache hit rate and how much of its "
            "drafting is hidden behind verification)")


def pin_process(cores: tuple[int, ...], threads: int) -> None:
    """Run this process on ``cores`` with ``threads`` torch threads."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


class TargetPinning:
    """``pin(True)`` keeps the target on its own cores while a drafter process runs on the
    others; ``pin(False)`` gives it back every core it had (no drafter running)."""

    def __init__(self, cores: tuple[int, ...] | None, threads: int | None) -> None:
        self.cores = cores
        self.threads = threads or (len(cores) if cores else None)
        self._previous = (tuple(os.sched_getaffinity(0)), torch.get_num_threads())
        self._pinned = [False]
        # An engine dropped without close() still gives the process its cores and threads back.
        weakref.finalize(self, _unpin_if_pinned, self._pinned, self._previous, self.threads)

    def __call__(self, on: bool) -> None:
        if self.cores is None:
            return
        if on:
            pin_process(self.cores, self.threads)
        else:
            pin_process(*self._previous)
        self._pinned[0] = on


def _unpin_if_pinned(pinned: list[bool], previous: tuple, pinned_threads: int | None) -> None:
    """The cores back; the threads too unless someone set them since (the engine's own finalizer
    may have restored them first)."""
    if pinned[0]:
        os.sched_setaffinity(0, previous[0])
        if torch.get_num_threads() == pinned_threads:
            torch.set_num_threads(previous[1])
