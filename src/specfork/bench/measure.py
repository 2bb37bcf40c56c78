"""What one ``specfork bench`` cell records, and the timed loop every engine runs through
(specfork and its peers alike): ``repeat`` passes over the prompts in groups of ``batch_size``,
several configurations interleaved group by group."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specfork.bench.settings import BenchSettings
from specfork.bench.timing import median, timed


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
    auto_k_rounds: dict | None = None  # --k auto: the timed decode rounds by k ("k=N") and mixed probes ("probe")
    ssd_hidden_fraction: float | None = None  # share of the drafter's work hidden behind verification
    # Tensor parallelism: the shards' sums (all-gather and add) per forward, ms each, share of the run.
    sums_per_forward: float | None = None
    sum_ms: float | None = None
    sum_share: float | None = None


Progress = Callable[[str, int], None]  # (generator's name, requests done)


def time_interleaved(generators: dict[str, Callable[[list[list[int]]], list]], prompts: list[list[int]],
                     s: BenchSettings, count: Callable = len,
                     progress: Progress | None = None) -> dict[str, tuple[list[float], list, list[float]]]:
    """``s.repeat`` timed passes of every generator over the prompts, interleaved: each group of
    ``batch_size`` prompts goes through every generator before the next group does, the order
    reversed from one group to the next (A B C, C B A, ...). A shared machine speeds up and slows
    down over minutes; run one after the other, a configuration could get a slow minute and
    another a fast one, and their ratio would show the machine, not the configurations (in one
    run on a Zen 4, n-gram lookup came out 1.21x faster than SD on ShareGPT where, interleaved,
    it was 0.90-0.92x). A generator's pass takes the sum of its groups' times.

    Returns per generator: the tokens/s of each pass (``count(output)`` tokens per output), the
    outputs of its last pass, and each of their requests' latency (its group's time)."""
    names = list(generators)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    last: dict[str, tuple[list, list[float]]] = {}
    backwards = False
    for _ in range(s.repeat):
        outputs: dict[str, list] = {name: [] for name in names}
        latencies: dict[str, list[float]] = {name: [] for name in names}
        seconds = dict.fromkeys(names, 0.0)
        for i in range(0, len(prompts), s.batch_size):
            for name in reversed(names) if backwards else names:
                group, took = timed(generators[name], prompts[i : i + s.batch_size])
                outputs[name].extend(group)
                latencies[name].extend([took] * len(group))
                seconds[name] += took
                if progress is not None:
                    progress(name, len(group))
            backwards = not backwards
        for name in names:
            speeds[name].append(sum(count(o) for o in outputs[name]) / seconds[name])
        last = {name: (outputs[name], latencies[name]) for name in names}
    return {name: (speeds[name], *last[name]) for name in names}


def throughput(speeds: list[float]) -> dict:
    """The RunResult fields of a run's per-pass tokens/s: the median, with min and max."""
    return {"tok_per_s": median(speeds), "tok_per_s_min": min(speeds), "tok_per_s_max": max(speeds)}
