"""What one ``specfork bench`` cell records, and the timed loop every engine runs through
(specfork and its peers alike): ``repeat`` passes over the prompts in groups of ``batch_size``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specfork.bench.settings import BenchSettings
from specfork.bench.timing import Stopwatch, median, timed


@dataclass
class RunResult:
    """One (configuration, dataset) cell."""

    name: str
    mode: str
    dataset: str
    settings: dict
    tok_per_s: float
    tok_per_s_min: float
    tok_per_s_max: float
    tokens: int
    mean_accepted_length: float | None = None
    ssd_cache_hit_rate: float | None = None
    match_ar: float | None = None
    latency_s: dict = field(default_factory=dict)  # p50/p90/p99 of per-request end-to-end time
    ttft_s: dict = field(default_factory=dict)
    point: int = 0  # index of the sweep point it belongs to
    weight_GBps: float | None = None  # --bandwidth, specfork AR: weight bytes per step x decode steps/s
    acceptance_by_position: list[float] | None = None  # accepted / proposed at each chain position
    by_source: dict | None = None  # SD with lookup first: rounds, proposed, accepted per proposal source
    draft_step_ratio: float | None = None  # one draft step / one target decode step (SD with a draft or head)
    ssd_hidden_fraction: float | None = None  # share of the drafter's work hidden behind verification
    # Tensor parallelism: the shards' sums (all-gather and add) per forward, ms each, share of the run.
    sums_per_forward: float | None = None
    sum_ms: float | None = None
    sum_share: float | None = None


def time_passes(generate_group: Callable[[list[list[int]]], list], prompts: list[list[int]], s: BenchSettings,
                count: Callable = len, progress=None) -> tuple[list[float], list, list[float]]:
    """``s.repeat`` timed passes of ``generate_group(prompts[i : i + batch_size])`` over the prompts.

    Returns the tokens/s of each pass (``count(output)`` tokens per output over the pass's wall
    time), the outputs of the last pass, and each of its requests' latency (its group's time)."""
    speeds, outputs, latencies = [], [], []
    for _ in range(s.repeat):
        outputs, latencies = [], []
        with Stopwatch() as whole:
            for i in range(0, len(prompts), s.batch_size):
                group, seconds = timed(generate_group, prompts[i : i + s.batch_size])
                outputs.extend(group)
                latencies.extend([seconds] * len(group))
                if progress is not None:
                    progress.update(len(group))
        speeds.append(sum(count(o) for o in outputs) / whole.seconds)
    return speeds, outputs, latencies


def throughput(speeds: list[float]) -> dict:
    """The RunResult fields of a run's per-pass tokens/s: the median, with min and max."""
    return {"tok_per_s": median(speeds), "tok_per_s_min": min(speeds), "tok_per_s_max": max(speeds)}
