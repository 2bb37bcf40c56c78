"""What every peer shares: a loaded peer as one ``generate_group`` function, its warm-up, and its
cell. The runner times peers in the same loop as specfork's modes
(:func:`specfork.bench.runner.run_interleaved`)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from specfork.bench.measure import RunResult, throughput
from specfork.bench.settings import BenchSettings
from specfork.bench.timing import percentiles

GenerateGroup = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, new tokens) -> new token ids


@dataclass(frozen=True)
class PeerRun:
    """One peer configuration: its name ("llama.cpp AR"), its kind ("AR") and ``open()``, which
    loads it for as long as the context lasts and yields its ``generate_group``."""

    name: str
    kind: str
    open: Callable[[], AbstractContextManager[GenerateGroup]]


def warm_up(generate_group: GenerateGroup, prompts: list[list[int]], s: BenchSettings) -> None:
    for _ in range(s.warmup):
        generate_group(prompts[: s.batch_size], 8)


def peer_result(run: PeerRun, dataset: str, s: BenchSettings, speeds: list[float], outputs: list[list[int]],
                latencies: list[float]) -> tuple[RunResult, list]:
    """The cell of ``run``'s timed passes; a request's latency is its group's."""
    settings = {"output_len": s.output_len, **({"batch_size": s.batch_size} if s.batch_size > 1 else {}),
                **({"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k} if s.temperature > 0 else {})}
    result = RunResult(name=run.name, mode=run.kind, dataset=dataset, settings=settings, **throughput(speeds),
                       tokens=sum(len(o) for o in outputs), latency_s=percentiles(latencies))
    return result, outputs


def one_at_a_time(generate: Callable[[list[int], int], list[int]]) -> GenerateGroup:
    """A peer's single-sequence ``generate(ids, n)`` as a ``generate_group``."""
    return lambda group, n: [generate(ids, n) for ids in group]
