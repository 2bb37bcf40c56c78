"""Opt-in (`pytest -m peer`): llama.cpp through `specfork bench` on the embedded model, where the
optional `llama-cpp-python` extra is installed (`pip install -e ".[peers]"`)."""

from __future__ import annotations

from dataclasses import replace

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
    assert set(rows) == {"specfork ar", "llama.cpp AR", "llama.cpp prompt-lookup"}
    peer = rows["llama.cpp AR"]
    assert peer["tokens"] == 2 * 32 and peer["tok_per_s"] > 0
    assert peer["match_ar"] >= 0.5  # same GGUF, greedy; llama.cpp rounds activations to int8, so near-ties may differ


def test_llama_cpp_stops_at_its_eos_with_no_ignore_eos():
    """HumanEval's third prompt ends within 60 tokens (greedy, specfork and llama.cpp alike): with
    --no-ignore-eos llama.cpp's runs, one at a time and batched, end there on the EOS."""
    pytest.importorskip("llama_cpp", reason="the optional peer llama-cpp-python is not installed")
    from specfork import LLM
    from specfork.bench.peers.llama_cpp_batched_peer import llama_cpp_batched_run
    from specfork.bench.peers.llama_cpp_peer import llama_cpp_run
    from specfork.bench.runner import load_prompt_ids, run_interleaved

    settings = BenchSettings(modes=("ar",), datasets=("humaneval",), num_prompts=3, output_len=200, warmup=0,
                             threads=2, ignore_eos=False)
    with LLM(threads=2) as llm:
        prompts = load_prompt_ids(llm, "humaneval", settings)
        eos = llm.engine.eos_token_ids
    for peer_run, batch_size in ((llama_cpp_run, 1), (llama_cpp_batched_run, 3)):
        s = replace(settings, batch_size=batch_size)
        result, outputs = run_interleaved([], "humaneval", prompts, s, peers=[peer_run("AR", prompts, s)])[1][0]
        for out in outputs:
            assert len(out) == 200 or (out[-1] in eos and not eos & set(out[:-1]))
        assert len(outputs[2]) < 60 and result.tokens == sum(len(out) for out in outputs)


def test_llama_cpp_samples_with_the_bench_settings_one_request_at_a_time():
    """At temperature > 0 llama.cpp samples (its outputs leave the greedy ones) with the bench's
    settings, seeded (the same seed draws the same tokens); its batched peer stays greedy only."""
    pytest.importorskip("llama_cpp", reason="the optional peer llama-cpp-python is not installed")
    from specfork import LLM
    from specfork.bench.peers.llama_cpp_peer import llama_cpp_run
    from specfork.bench.runner import load_prompt_ids, run_interleaved

    settings = BenchSettings(modes=("ar",), datasets=("humaneval",), num_prompts=2, output_len=48, warmup=0,
                             threads=2)
    with LLM(threads=2) as llm:
        prompts = load_prompt_ids(llm, "humaneval", settings)

    def outputs(s):
        return run_interleaved([], "humaneval", prompts, s, peers=[llama_cpp_run("AR", prompts, s)])[1][0][1]

    sampled = replace(settings, temperature=1.0, top_p=0.95, seed=5)
    first, greedy = outputs(sampled), outputs(settings)
    assert [len(o) for o in first] == [48, 48] and first != greedy
    assert outputs(sampled) == first
    notes = []
    from specfork.bench.peers import peer_runs

    assert peer_runs("llama.cpp", prompts, replace(sampled, batch_size=2), notes.append) == []
    assert notes == ["skipping llama.cpp: llama.cpp's batched peer runs are greedy only"]
