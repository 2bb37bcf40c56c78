"""What every peer shares: its warm-up and timing, exactly as specfork's own runs are timed."""

from __future__ import annotations

from collections.abc import Callable

from specfork.bench.measure import RunResult, throughput, time_passes
from specfork.bench.settings import BenchSettings
from specfork.bench.timing import percentiles

GenerateGroup = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, new tokens) -> new token ids


def time_peer(name: str, kind: str, dataset: str, prompts: list[list[int]], s: BenchSettings,
              generate_group: GenerateGroup) -> tuple[RunResult, list]:
    """Warm up, then time ``generate_group(prompts[i : i + batch_size], output_len)`` over the prompts
    ``repeat`` times (as specfork's runs are timed); a request's latency is its group's."""
    for _ in range(s.warmup):
        generate_group(prompts[: s.batch_size], 8)
    speeds, outputs, latencies = time_passes(lambda group: generate_group(group, s.output_len), prompts, s)
    settings = {"output_len": s.output_len, **({"batch_size": s.batch_size} if s.batch_size > 1 else {})}
    result = RunResult(name=name, mode=kind, dataset=dataset, settings=settings, **throughput(speeds),
                       tokens=sum(len(o) for o in outputs), latency_s=percentiles(latencies))
    return result, outputs


def one_at_a_time(generate: Callable[[list[int], int], list[int]]) -> GenerateGroup:
    """A peer's single-sequence ``generate(ids, n)`` as a ``generate_group`` for :func:`time_peer`."""
    return lambda group, n: [generate(ids, n) for ids in group]
