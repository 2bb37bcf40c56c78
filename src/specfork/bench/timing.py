"""One clock and one percentile definition for every benchmark (``specfork bench``,
``specfork bench-serve`` and the scripts in ``benchmarks/``). No torch: importing it is free.

* Clock: :func:`time.perf_counter` (monotonic, the highest resolution the platform has).
* Percentiles: linear interpolation between the two nearest ranks (numpy's default ``linear``
  method, Hyndman and Fan's type 7). For sorted values ``x[0..n-1]`` the ``q``-th percentile
  sits at rank ``h = (n - 1) * q / 100``: ``x[floor(h)] + (h - floor(h)) * (x[ceil(h)] -
  x[floor(h)])``. The 50th is the median (the mean of the two middle values when ``n`` is even),
  the 0th the minimum, the 100th the maximum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

clock = time.perf_counter


class Stopwatch:
    """``with Stopwatch() as sw: ...`` leaves the elapsed seconds in ``sw.seconds``;
    ``sw.elapsed()`` reads the time so far while it runs."""

    __slots__ = ("start", "seconds")

    def __enter__(self) -> Stopwatch:
        self.start = clock()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = clock() - self.start

    def elapsed(self) -> float:
        return clock() - self.start


def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """``(fn(*args, **kwargs), seconds it took)``."""
    start = clock()
    result = fn(*args, **kwargs)
    return result, clock() - start


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``, linearly interpolated (module docstring)."""
    s = sorted(values)
    if not s:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    h = (len(s) - 1) * q / 100
    lo, hi = math.floor(h), math.ceil(h)
    return s[lo] + (s[hi] - s[lo]) * (h - lo)


def median(values: Iterable[float]) -> float:
    return percentile(values, 50)


def percentiles(values: Iterable[float], qs: Iterable[float] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ...}``; ``{}`` for no values."""
    values = list(values)
    return {f"p{q:g}": percentile(values, q) for q in qs} if values else {}


def summary(values: Iterable[float], qs: Iterable[float] = (50, 99)) -> dict[str, float | None]:
    """``{"mean": ..., "p50": ..., "p99": ...}``, every entry None for no values."""
    values, qs = list(values), list(qs)
    if not values:
        return {"mean": None, **{f"p{q:g}": None for q in qs}}
    return {"mean": sum(values) / len(values), **percentiles(values, qs)}
