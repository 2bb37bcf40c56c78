"""The one percentile definition every benchmark uses: linear interpolation between ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specfork.bench.timing import Stopwatch, median, percentile, percentiles, summary, timed


def test_percentile_interpolates_between_ranks_with_exact_values():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose; sorted: 1, 2, 3, 4
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # rank 1.5: halfway between 2 and 3 (not the upper middle)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97 (not the maximum)
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 25) == 20.0  # rank 1 exactly
    assert percentile([7.0], 99) == 7.0
    assert median([5.0, 1.0, 3.0]) == 3.0 and median([1.0, 2.0]) == 1.5


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 100):
        values = rng.exponential(size=n).tolist()
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_percentiles_and_summary_shapes():
    assert percentiles([1.0, 2.0, 3.0, 4.0]) == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert percentiles([]) == {}
    assert summary([1.0, 2.0, 3.0, 4.0]) == pytest.approx({"mean": 2.5, "p50": 2.5, "p99": 3.97})
    assert summary([]) == {"mean": None, "p50": None, "p99": None}


def test_stopwatch_and_timed_measure_wall_time():
    with Stopwatch() as sw:
        time.sleep(0.02)
        assert sw.elapsed() >= 0.02
    assert 0.02 <= sw.seconds < 1.0
    result, seconds = timed(lambda x: x + 1, 41)
    assert result == 42 and 0 <= seconds < 1.0
