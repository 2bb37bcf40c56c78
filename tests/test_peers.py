"""Opt-in (`pytest -m peer`): llama.cpp through `specfork bench` on the embedded model, where the
optional `llama-cpp-python` extra is installed (`pip install -e ".[peers]"`)."""

from __future__ import annotations

import pytest

from specfork.bench.runner import run_benchmark
from specfork.bench.settings import BenchSettings

pytestmark = pytest.mark.peer


def test_llama_cpp_runs_beside_specfork_on_the_same_gguf():
    pytest.importorskip("llama_cpp", reason="the optional peer llama-cpp-python is not installed")
    settings = BenchSettings(modes=("ar",), datasets=("humaneval",), num_prompts=2, output_len=32, warmup=0,
                             threads=2, peers=("llama.cpp",))
    report = run_benchmark(settings, [{}], progress=False)
    rows = {r["name"]: r for r in report["results"]}
    assert set(rows) == {"specfork ar", "llama.cpp AR"}
    peer = rows["llama.cpp AR"]
    assert peer["tokens"] == 2 * 32 and peer["tok_per_s"] > 0
    assert peer["match_ar"] >= 0.5  # same GGUF, greedy; llama.cpp rounds activations to int8, so near-ties may differ
