"""`specfork bench` smoke runs on tiny random models: files, fields, AR checks, peer skips."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from builders import TINY_VOCAB, llama, randomize_

from specfork.bench.report import (
    COLUMNS,
    auto_k_summary,
    chart_series,
    format_table,
    markdown,
    plots,
    source_summary,
    table_rows,
    write_all,
)
from specfork.bench.runner import parse_sweep, run_benchmark
from specfork.bench.settings import MODE_OPTIONS, PEER_OPTIONS, BenchSettings, dataset_list
from specfork.cli import main
from specfork.errors import SpecforkError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny"
    torch.manual_seed(3)
    model = llama(num_hidden_layers=2).float().eval()
    randomize_(model, 3)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _settings(tiny, **kw):
    base = dict(model=tiny, draft=tiny, modes=("ar", "sd", "ngram", "ssd"), datasets=("random",), num_prompts=2,
                input_len=12, output_len=10, k=3, warmup=1, repeat=2, threads=2)
    modes = set(kw.get("modes", base["modes"])) | set(kw.get("peers", ()))
    for name in ("draft", "k"):  # the speculative settings, where a run reads them (bench refuses them otherwise)
        if not set(MODE_OPTIONS[name] + PEER_OPTIONS.get(name, ())) & modes:
            del base[name]
    return BenchSettings(**{**base, **kw})


def test_bench_writes_json_markdown_and_plots(tiny, tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    report = run_benchmark(_settings(tiny, peers=("llama.cpp", "transformers")), [{}], progress=False)
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"] == torch.__version__
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"ar", "sd", "ngram", "ssd", "AR", "prompt-lookup", "assisted"}
    for r in rows.values():
        assert r["tok_per_s_min"] <= r["tok_per_s"] <= r["tok_per_s_max"]
        assert r["tokens"] == 2 * 10
        if r["name"] == "specfork ar":
            assert r["match_ar"] is None  # the reference itself
        elif r["name"].startswith("specfork"):
            assert r["match_ar"] == 1.0  # greedy: every specfork mode reproduces AR
        else:
            assert 0.0 <= r["match_ar"] <= 1.0
        assert set(r["latency_s"]) == {"p50", "p90", "p99"}
    assert rows["sd"]["mean_accepted_length"] >= 2.9  # draft == target: every draft accepted (budget-capped)
    assert rows["sd"]["acceptance_by_position"][0] == 1.0  # every first draft accepted
    # Measured, so only its presence is tested: with draft == target the ratio is about 1 on a
    # quiet machine, but a loaded one slowed one side 40x in a run (0.024), and the size of a
    # timing is the benchmark's business, not a unit test's.
    assert rows["sd"]["draft_step_ratio"] > 0
    assert rows["ssd"]["ssd_hidden_fraction"] is not None and rows["ngram"]["draft_step_ratio"] is None
    assert rows["ssd"]["ssd_cache_hit_rate"] > 0.3
    assert any("skipping llama.cpp: llama-cpp-python is not installed" in n for n in report["notes"])

    paths = write_all(report, tmp_path / "out", "specfork bench (test)")
    saved = json.loads(paths["json"].read_text())
    assert saved["command"] == "specfork bench (test)" and saved["results"] == report["results"]
    md = paths["markdown"].read_text()
    assert "| run | dataset | tok/s |" in md and "specfork ssd k=3 fan_out=3 backup=jit" in md
    assert "Acceptance by chain position" in md and "* specfork sd k=3 input_len=12, random: 1.00" in md
    for name in ("tok_per_s", "speedup", "accepted_length", "ssd_hit_rate", "latency_p50", "latency_p99"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(report)
    assert "vs AR" in table and "1.00x" in table and "vs transformers AR" in table


def test_a_mode_that_differs_from_ar_is_reported_as_differing(tiny, monkeypatch):
    from specfork.bench import runner

    real = runner.run_interleaved

    def ngram_off_by_one(modes, *args, **kwargs):
        cells, peers = real(modes, *args, **kwargs)
        for mode, (_, tokens) in zip(modes, cells, strict=True):
            if mode == "ngram":  # one output differs from AR in its last token
                tokens[0] = [*tokens[0][:-1], (tokens[0][-1] + 1) % 256]
        return cells, peers

    monkeypatch.setattr(runner, "run_interleaved", ngram_off_by_one)
    report = run_benchmark(_settings(tiny, modes=("ar", "ngram"), repeat=1, warmup=0), [{}], progress=False)
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["ar"]["match_ar"] is None and rows["ngram"]["match_ar"] == 0.5  # 1 of 2 prompts equal
    cells = {row[0].split()[1]: row[COLUMNS.index("= AR")] for row in table_rows(report)}
    assert cells["ar"] == "\u2014" and cells["ngram"] == "50%"


def test_plots_only_show_runs_with_data(tiny, tmp_path):
    report = run_benchmark(_settings(tiny, modes=("ar", "sd"), repeat=1, warmup=0), [{}], progress=False)
    rows = table_rows(report)
    runs, values = chart_series(rows, COLUMNS.index("accept len"))
    sd, ar = "specfork sd k=3 input_len=12", "specfork ar input_len=12"
    assert runs == [sd] and values[(sd, "random")] >= 1.0 and values[(ar, "random")] is None
    assert chart_series(rows, COLUMNS.index("tok/s"))[0] == [ar, sd]
    out = tmp_path / "plots"
    out.mkdir()
    (out / "ssd_hit_rate.png").write_bytes(b"stale")  # from an earlier run with SSD
    written = {p.stem for p in plots(report, out)}
    assert written == {"tok_per_s", "speedup", "accepted_length", "latency_p50", "latency_p99"}
    assert not (out / "ssd_hit_rate.png").exists()


def test_batched_runs_include_transformers_batched_ar(tiny):
    report = run_benchmark(_settings(tiny, modes=("ar",), num_prompts=4, batch_size=2, peers=("transformers",)),
                           [{}], progress=False)
    rows = {r["name"]: r for r in report["results"]}
    assert set(rows) == {"specfork ar", "transformers AR"}
    peer = rows["transformers AR"]
    assert peer["settings"]["batch_size"] == 2 and peer["tokens"] == 4 * 10
    assert peer["match_ar"] >= 0.5  # left-padded fp32 batches; near-ties may differ
    assert any("batched runs are AR only" in n for n in report["notes"])


def _with_eos(tiny: str, eos: int, directory) -> str:
    """A copy of the tiny model whose EOS is ``eos``."""
    import shutil

    model = directory / f"tiny-eos-{eos}"
    shutil.copytree(tiny, model)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model / name).read_text())
        cfg["eos_token_id"] = eos
        (model / name).write_text(json.dumps(cfg))
    return str(model)


def _to_eos(out: list[int], eos: int) -> list[int]:
    return out[: out.index(eos) + 1] if eos in out else out


def test_no_ignore_eos_stops_specfork_at_the_eos(tiny, tmp_path):
    """With --no-ignore-eos a request ends at its EOS in every specfork mode; the tiny model's EOS
    is made the 4th token AR produces for the first prompt."""
    from specfork.bench.runner import run_interleaved
    from specfork.datasets import random_token_prompts

    settings = _settings(tiny, modes=("ar", "sd", "ngram"), repeat=1, warmup=0)
    prompts = random_token_prompts(2, 12, TINY_VOCAB, seed=settings.seed)
    full = run_interleaved(["ar"], "random", prompts, settings)[0][0][1]
    eos = full[0][3]
    model = _with_eos(tiny, eos, tmp_path)
    report = run_benchmark(replace(settings, model=model, draft=model, ignore_eos=False), [{}], progress=False)
    rows = {r["name"]: r for r in report["results"]}
    assert rows["specfork ar"]["tokens"] == sum(len(_to_eos(out, eos)) for out in full) < 2 * 10
    for mode in ("sd", "ngram"):
        assert rows[f"specfork {mode}"]["tokens"] == rows["specfork ar"]["tokens"]
        assert rows[f"specfork {mode}"]["match_ar"] == 1.0
    assert "up to 10 output tokens (each request stops at its EOS)" in markdown(report, "specfork bench")
    assert "10 output tokens (EOS ignored)" in markdown(run_benchmark(replace(settings, modes=("ar",), draft="default", k=None), [{}],
                                                                      progress=False), "specfork bench")


@pytest.mark.parametrize("batch_size", [1, 2])
def test_no_ignore_eos_stops_the_transformers_peer_at_the_eos(tiny, tmp_path, batch_size):
    from specfork.bench.peers.transformers_peer import transformers_run
    from specfork.bench.runner import run_interleaved
    from specfork.datasets import random_token_prompts

    def run_peer(s):
        return run_interleaved([], "random", prompts, s, peers=[transformers_run("AR", s)])[1][0]

    settings = _settings(tiny, modes=("ar",), repeat=1, warmup=0, batch_size=batch_size)
    prompts = random_token_prompts(2, 12, TINY_VOCAB, seed=settings.seed)
    full = run_peer(settings)[1]
    eos = full[0][3]
    model = _with_eos(tiny, eos, tmp_path)
    result, outs = run_peer(replace(settings, model=model, ignore_eos=False))
    assert outs == [_to_eos(out, eos) for out in full] and result.tokens < 2 * 10


def test_peer_ratios_compare_within_each_sweep_point():
    def row(name, mode, point, tok_per_s):
        return {"name": name, "mode": mode, "dataset": "humaneval", "point": point, "settings": {},
                "tok_per_s": tok_per_s, "tok_per_s_min": tok_per_s, "tok_per_s_max": tok_per_s}

    report = {"results": [row("specfork ar", "ar", 0, 160.0), row("llama.cpp AR", "AR", 0, 100.0),
                          row("specfork ar", "ar", 1, 170.0), row("llama.cpp AR", "AR", 1, 85.0)]}
    lines = format_table(report).splitlines()[2:]
    assert [line.split()[-1] for line in lines] == ["1.60x", "1.00x", "2.00x", "1.00x"]


def test_a_point_without_its_own_peer_run_compares_with_the_peer_run_of_its_workload():
    """``--sweep "batch_size=1,8;weights=native,native-int8"``: llama.cpp runs once per batch size
    (points 0 and 2); the int8 points (1, 3) compare with the run of their own batch size."""
    def row(name, mode, point, batch, tok_per_s, **settings):
        return {"name": name, "mode": mode, "dataset": "humaneval", "point": point,
                "settings": {"output_len": 128, "batch_size": batch, **settings},
                "tok_per_s": tok_per_s, "tok_per_s_min": tok_per_s, "tok_per_s_max": tok_per_s}

    report = {"results": [row("specfork ar", "ar", 0, 1, 200.0), row("llama.cpp AR", "AR", 0, 1, 100.0),
                          row("specfork ar", "ar", 1, 1, 150.0, weights="native-int8"),
                          row("specfork ar", "ar", 2, 8, 400.0), row("llama.cpp AR", "AR", 2, 8, 125.0),
                          row("specfork ar", "ar", 3, 8, 500.0, weights="native-int8")]}
    lines = format_table(report).splitlines()[2:]
    assert [line.split()[-1] for line in lines] == ["2.00x", "1.00x", "1.50x", "3.20x", "1.00x", "4.00x"]


def test_sweep_grid_and_errors():
    assert parse_sweep("k=2,3;fan_out=1,3") == [
        {"k": 2, "fan_out": 1}, {"k": 2, "fan_out": 3}, {"k": 3, "fan_out": 1}, {"k": 3, "fan_out": 3}]
    assert parse_sweep(None) == [{}]
    with pytest.raises(SpecforkError, match="cannot sweep"):
        parse_sweep("layers=2")
    with pytest.raises(SpecforkError, match="bad value"):
        parse_sweep("k=two")
    with pytest.raises(SpecforkError, match="unknown modes"):
        BenchSettings(modes=("ar", "eagle"))
    with pytest.raises(SpecforkError, match="random dataset needs --input-len"):
        BenchSettings(datasets=("random",))
    assert parse_sweep("k=auto,3") == [{"k": "auto"}, {"k": 3}]
    assert parse_sweep("cuda_graphs=off,on") == [{"cuda_graphs": False}, {"cuda_graphs": True}]
    with pytest.raises(SpecforkError, match="bad value"):
        parse_sweep("cuda_graphs=maybe")
    with pytest.raises(SpecforkError, match="k auto is for the sd and ngram modes"):
        BenchSettings(k="auto", modes=("ar", "ssd"))
    with pytest.raises(SpecforkError, match="k must be an integer >= 1 or auto"):
        BenchSettings(k="three")
    with pytest.raises(SpecforkError, match="device must be 'cpu' or 'cuda"):
        BenchSettings(device="tpu")
    with pytest.raises(SpecforkError, match="k: given twice"):
        parse_sweep("k=2;k=3")  # the second used to replace the first silently
    with pytest.raises(SpecforkError, match="--datasets needs at least one"):
        BenchSettings(datasets=())
    assert BenchSettings(datasets=dataset_list("sharegpt, sharegpt,humaneval")).datasets == ("sharegpt", "humaneval")
    # a sweep point's dataset is validated like --datasets, before any model loads (a traceback before)
    for sweep, message in (("dataset=random", "random dataset needs --input-len"), ("dataset=foo", "unknown datasets")):
        with pytest.raises(SpecforkError, match=message):
            run_benchmark(BenchSettings(modes=("ar",)), parse_sweep(sweep), progress=False)


def test_the_warm_up_runs_every_group_to_its_end_on_cuda_and_one_short_group_on_the_cpu():
    """On CUDA the timed runs must meet no window or key bucket whose CUDA graph the warm-up did
    not capture, so it runs what a timed run runs; on the CPU a short run of the first group."""
    from specfork import SamplingParams
    from specfork.bench.runner import warm_up_groups

    prompts = [[1, 2], [3], [4, 5, 6], [7], [8]]
    params = SamplingParams(max_tokens=256, ignore_eos=True)
    cuda = warm_up_groups(prompts, params, BenchSettings(device="cuda", batch_size=2))
    assert [group for group, _ in cuda] == [prompts[0:2], prompts[2:4], prompts[4:]]
    assert all(p.max_tokens == 256 for _, p in cuda)
    [(group, short)] = warm_up_groups(prompts, params, BenchSettings(batch_size=2))
    assert group == prompts[:2] and short.max_tokens == 16 and short.ignore_eos


def test_bench_runs_specfork_on_the_chosen_device():
    from specfork.bench.runner import _cell_settings, _engine_options

    s = BenchSettings(device="cuda:1")
    assert all(_engine_options(mode, s)["device"] == "cuda:1" for mode in ("ar", "sd", "ssd", "ngram"))
    assert _cell_settings("ar", s)["device"] == "cuda:1" and "device" not in _cell_settings("ar", BenchSettings())
    # k: the engine's default unless given (auto for SD and n-gram lookup, a fixed k for SSD), shown resolved
    assert [_cell_settings(m, BenchSettings())["k"] for m in ("sd", "ngram", "ssd")] == ["auto", "auto", 5]
    assert "k" not in _cell_settings("ar", BenchSettings()) and _cell_settings("sd", BenchSettings(k=3))["k"] == 3
    eager = BenchSettings(device="cuda", cuda_graphs=False)
    assert _engine_options("sd", eager)["cuda_graphs"] is False and _cell_settings("ar", eager)["cuda_graphs"] is False
    # the warm-up and the repeats run the same prompts: no mode may skip their prefill
    assert not any(_engine_options(mode, s)["prefix_caching"] for mode in ("ar", "sd", "ssd", "ngram"))


def _bench_cli(out, *argv: str) -> dict:
    """``specfork bench ARGV --out OUT --no-progress``, which must succeed; its results.json."""
    assert main(["bench", *argv, "--out", str(out), "--no-progress"]) == 0
    return json.loads((out / "results.json").read_text())


def test_bench_cli_sweep_and_all_rows(tiny, tmp_path, capsys):
    out = tmp_path / "cli"
    report = _bench_cli(out, "--model", tiny, "--draft", tiny, "--modes", "ar,sd", "--datasets", "random",
                        "--input-len", "8", "--num-prompts", "2", "--output-len", "6", "--sweep", "k=2,4", "--warmup", "0")
    assert report["command"].startswith("specfork bench --model")
    ks = sorted(r["settings"]["k"] for r in report["results"] if r["mode"] == "sd")
    assert ks == [2, 4]
    printed = capsys.readouterr().out
    assert "specfork sd k=2" in printed
    m = report["machine"]  # the machine line names what ran (the GPU only where there is one)
    assert f"machine: {m['cpu']}, {m['cores']} cores; native kernels: {m['kernels']}" in printed
    assert f"commit {m['commit']}" in printed and ("; GPU: " in printed) == (m["cuda"] is not None)


def test_bench_samples_with_top_p_and_top_k_in_every_engine_and_states_them(tiny, tmp_path, capsys, monkeypatch):
    """--top-p / --top-k reach specfork's requests and transformers' generate (not its default
    top-k 50), are swept, labelled, stated in results.md, and the peer's ratio compares like with like."""
    from specfork.bench.peers import transformers_peer

    seen, real_load = set(), transformers_peer._load

    def recording_load(name):
        model = real_load(name)
        generate = model.generate

        def recorded(*args, **kwargs):
            if "pad_token_id" in kwargs:  # the peer's own calls (assisted generation calls its draft's too)
                seen.add(tuple(kwargs.get(k) for k in ("do_sample", "temperature", "top_p", "top_k")))
            return generate(*args, **kwargs)

        model.generate = recorded
        return model

    monkeypatch.setattr(transformers_peer, "_load", recording_load)
    out = tmp_path / "filters"
    report = _bench_cli(out, "--model", tiny, "--draft", tiny, "--modes", "ar", "--datasets", "random",
                        "--input-len", "8", "--num-prompts", "2", "--output-len", "6", "--temperature", "0.8", "--top-k", "5",
                        "--sweep", "top_p=0.5,1.0", "--peers", "transformers", "--warmup", "0")
    rows = report["results"]
    ours = [r["settings"] for r in rows if r["name"] == "specfork ar"]
    assert [(st["temperature"], st["top_p"], st["top_k"]) for st in ours] == [(0.8, 0.5, 5), (0.8, 1.0, 5)]
    assert seen == {(True, 0.8, 0.5, 5), (True, 0.8, 1.0, 5)}
    peer = [r["settings"] for r in rows if r["name"] == "transformers AR"]
    assert [(st["top_p"], st["top_k"]) for st in peer] == [(0.5, 5), (1.0, 5)]
    printed = capsys.readouterr().out
    assert "specfork ar input_len=8 T=0.8 top_p=0.5 top_k=5 " in printed
    assert "specfork ar input_len=8 T=0.8 top_k=5 " in printed and "transformers AR T=0.8 top_k=5 " in printed
    assert "temperature 0.8, top-k 5, batch size 1" in (out / "results.md").read_text()
    with pytest.raises(SpecforkError, match="top_p must be in"):
        _settings(tiny, top_p=0.0)


def test_greedy_points_that_differ_only_in_filters_share_one_peer_run(tiny):
    """top-p and top-k change nothing greedy: the greedy points of a sweep over them run each peer
    once (the sampled points once per value)."""
    report = run_benchmark(_settings(tiny, modes=("ar",), num_prompts=1, peers=("transformers",), repeat=1, warmup=0),
                           parse_sweep("temperature=0,0.5;top_p=0.5,1.0"), progress=False)
    peer_rows = [r for r in report["results"] if r["name"] == "transformers AR"]
    assert sorted(r["settings"].get("temperature", 0.0) for r in peer_rows) == [0.0, 0.5, 0.5]


def test_bench_refuses_settings_that_no_run_reads(tiny):
    """Options and sweep axes that none of --modes reads, and sampling filters where every run is
    greedy, are refused before anything loads (they ran the same runs once per value)."""
    with pytest.raises(SpecforkError, match="only the sd, ssd, ngram modes read k"):
        _settings(tiny, modes=("ar",), k=3)
    with pytest.raises(SpecforkError, match="only the ssd mode reads fan_out"):
        _settings(tiny, modes=("ar", "sd"), fan_out=2)
    assert _settings(tiny, modes=("ar", "ssd"), fan_out=2).fan_out == 2
    with pytest.raises(SpecforkError, match="only the sd, ssd modes and the transformers peer read draft"):
        BenchSettings(model=tiny, draft=tiny, modes=("ar",), peers=("llama.cpp",))
    assert BenchSettings(model=tiny, draft=tiny, modes=("ar",), peers=("transformers",)).draft == tiny
    with pytest.raises(SpecforkError, match="--sweep draft_confidence: only the sd mode"):
        run_benchmark(_settings(tiny, modes=("ar", "ngram")), parse_sweep("draft_confidence=0.2,0.3"), progress=False)
    with pytest.raises(SpecforkError, match="--sweep k would replace --k 3"):
        run_benchmark(_settings(tiny, modes=("ar", "sd"), k=3), parse_sweep("k=2,4"), progress=False)
    swept = run_benchmark(_settings(tiny, modes=("ar",), output_len=4, repeat=1, warmup=0), parse_sweep("input_len=8,12"),
                          progress=False)  # the random dataset needs --input-len, and its sweep replaces it
    assert [r["settings"]["input_len"] for r in swept["results"]] == [8, 12]
    with pytest.raises(SpecforkError, match="top_p filters sampling at temperature > 0"):
        run_benchmark(_settings(tiny, modes=("ar",)), parse_sweep("top_p=0.5,1.0"), progress=False)
    # decode steps: AR reads them, SD only at k auto (its plain rounds), SSD never
    with pytest.raises(SpecforkError, match="only the ar, sd, ngram modes read decode_steps"):
        _settings(tiny, modes=("ssd",), decode_steps=2)
    with pytest.raises(SpecforkError, match="SD's runs read it only at k auto"):
        _settings(tiny, modes=("sd",), k=3, decode_steps=2)
    assert _settings(tiny, modes=("sd",), k="auto", decode_steps=2).decode_steps == 2


def test_bench_sweeps_lookup_first(tiny, tmp_path, capsys):
    """--sweep lookup_first=0,2 runs SD with the draft alone and with prompt lookup first, labelled."""
    out = tmp_path / "lookup"
    report = _bench_cli(out, "--model", tiny, "--draft", tiny, "--modes", "sd", "--datasets", "random", "--input-len", "8",
                        "--num-prompts", "1", "--output-len", "6", "--k", "2", "--sweep", "lookup_first=0,2", "--warmup", "0")
    assert [r["settings"].get("lookup_first") for r in report["results"]] == [None, 2]
    assert "specfork sd k=2 lookup_first=2" in capsys.readouterr().out
    plain, looked_up = report["results"]
    assert plain["by_source"] is None  # one source: nothing to split
    rounds = sum(c["rounds"] for c in looked_up["by_source"].values())
    assert rounds > 0 and "Rounds by proposal source" in (out / "results.md").read_text()


def test_bench_reports_k_autos_rounds_by_k(tiny, tmp_path):
    """With --k auto every SD cell records its timed decode rounds by k (warm-up excluded)."""
    out = tmp_path / "auto"
    report = _bench_cli(out, "--model", tiny, "--draft", tiny, "--modes", "ar,sd", "--datasets", "random", "--input-len", "8",
                        "--num-prompts", "2", "--output-len", "12", "--k", "auto", "--batch-size", "2", "--warmup", "1")
    ar, sd = report["results"]
    assert ar["auto_k_rounds"] is None
    rounds = sd["auto_k_rounds"]
    assert set(rounds) <= {"probe", *(f"k={k}" for k in range(9))}
    # one batch of 2 after its prefill: 11 more tokens each, at least 2 rounds (k <= 8), at most 11
    # (a count that kept the warm-up's rounds too would be about twice the timed run's)
    assert 2 <= sum(rounds.values()) <= 11
    assert "k auto's decode rounds by k" in (out / "results.md").read_text()


def test_auto_k_summary_orders_by_k_with_probes_last():
    assert auto_k_summary({"probe": 3, "k=10": 1, "k=0": 94, "k=2": 2}) == "k=0 94%, k=2 2%, k=10 1%, probe 3% (100 rounds)"


def test_source_summary_gives_each_sources_share_and_acceptance():
    summary = source_summary({"lookup": {"rounds": 41, "proposed": 160, "accepted": 63},
                              "draft": {"rounds": 59, "proposed": 0, "accepted": 0}})
    assert summary == ("draft 59% of rounds, 0.00 accepted per round (- of proposed); "
                       "lookup 41% of rounds, 1.54 accepted per round (0.39 of proposed)")


def test_bench_sweeps_the_weights_option(tiny, tmp_path, capsys):
    """--sweep weights=native,native-int8 runs AR both ways (int8 activations), each row labelled."""
    out = tmp_path / "weights"
    report = _bench_cli(out, "--model", tiny, "--modes", "ar", "--datasets", "random", "--input-len", "8",
                        "--num-prompts", "1", "--output-len", "4", "--sweep", "weights=native,native-int8", "--warmup", "0")
    assert [r["settings"].get("weights") for r in report["results"]] == [None, "native-int8"]
    assert "specfork ar weights=native-int8" in capsys.readouterr().out


def test_bench_cli_accepts_k_auto(tiny, tmp_path, capsys):
    out = tmp_path / "auto"
    report = _bench_cli(out, "--model", tiny, "--modes", "ar,ngram", "--datasets", "random", "--input-len", "8",
                        "--num-prompts", "1", "--output-len", "6", "--k", "auto", "--warmup", "0")
    assert [r["settings"]["k"] for r in report["results"] if r["mode"] == "ngram"] == ["auto"]
    assert "specfork ngram k=auto" in capsys.readouterr().out


def test_bench_cli_bandwidth_adds_weight_bandwidth_columns(tiny, tmp_path, capsys, monkeypatch):
    from specfork.bench import runner

    measured = iter([{"read_GBps": 10.0, "copy_GBps": 9.0}, {"read_GBps": 20.0, "copy_GBps": 18.0}])
    monkeypatch.setattr(runner, "read_bandwidth", lambda: next(measured))  # before, after: no 1 GiB sums here
    out = tmp_path / "bw"
    report = _bench_cli(out, "--model", tiny, "--draft", tiny, "--modes", "ar,sd", "--datasets", "random",
                        "--input-len", "8", "--num-prompts", "2", "--output-len", "6", "--warmup", "0", "--bandwidth")
    assert report["machine"]["read_GBps"] == 20.0  # the higher of before and after
    assert report["machine"]["bandwidth"]["before"]["read_GBps"] == 10.0
    rows = {r["mode"]: r for r in report["results"]}
    assert rows["ar"]["weight_GBps"] > 0 and rows["sd"]["weight_GBps"] is None  # AR runs only
    printed = capsys.readouterr().out
    machine, header = printed.splitlines()[:2]
    assert f"native kernels: {report['machine']['kernels']}" in machine and machine.startswith("machine: ")
    words = " ".join(printed.split())  # the legend under the table, wrapped
    assert "accept len: tokens per target forward" in words and "Read bandwidth of this machine: 20.0 GB/s" in words
    assert header.split()[-2:] == ["wGB/s", "%bw"]
    cells = {row[0].split()[1]: row[len(COLUMNS):] for row in table_rows(report)}
    assert cells["ar"] == [f"{rows['ar']['weight_GBps']:.1f}", f"{rows['ar']['weight_GBps'] / 20.0:.0%}"]
    assert cells["sd"] == ["-", "-"]
    assert "Read bandwidth of this machine: 20.0 GB/s" in (out / "results.md").read_text()


def test_bandwidth_is_given_at_batch_1_only(tiny, monkeypatch):
    """In a batch a request's TPOT also holds the other requests' prefills: no weight bandwidth there."""
    from specfork.bench import runner

    monkeypatch.setattr(runner, "read_bandwidth", lambda: {"read_GBps": 10.0, "copy_GBps": 9.0})
    report = run_benchmark(_settings(tiny, modes=("ar",), repeat=1, warmup=0, bandwidth=True),
                           parse_sweep("batch_size=1,2"), progress=False)
    by_batch = {r["settings"]["batch_size"]: r["weight_GBps"] for r in report["results"]}
    assert by_batch[1] > 0 and by_batch[2] is None


def test_runs_that_share_a_label_across_sweep_points_are_named_apart(tiny, tmp_path):
    """AR beside each k of a k sweep: one row and one bar per point, named by the point."""
    report = run_benchmark(_settings(tiny, modes=("ar", "sd"), k=None, repeat=1, warmup=0), parse_sweep("k=2,3"),
                           progress=False)
    names = [row[0] for row in table_rows(report)]
    assert names == ["specfork ar input_len=12 @ k=2", "specfork sd k=2 input_len=12",
                     "specfork ar input_len=12 @ k=3", "specfork sd k=3 input_len=12"]
    runs, values = chart_series(table_rows(report), COLUMNS.index("tok/s"))
    assert runs == names and all(values[(name, "random")] > 0 for name in names)


def test_the_progress_bar_counts_the_peers_requests(tiny, monkeypatch):
    import tqdm

    bars = []

    class Bar:
        def __init__(self, total, **_):
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, n):
            self.n += n

        def refresh(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    run_benchmark(_settings(tiny, modes=("ar",), num_prompts=1, repeat=2, warmup=0, peers=("transformers",)),
                  [{}], progress=True)
    run_benchmark(_settings(tiny, modes=("ngram",), num_prompts=1, repeat=1, warmup=0), [{}], progress=True)
    peers, reference = bars
    assert peers.n == peers.total == 2 * (1 + 3)  # two passes over one prompt: specfork AR and three transformers runs
    assert reference.n == reference.total == 2  # n-gram and the AR it is checked against, unreported


def test_no_bandwidth_columns_by_default(tiny):
    report = run_benchmark(_settings(tiny, modes=("ar",), repeat=1, warmup=0), [{}], progress=False)
    assert "read_GBps" not in report["machine"] and report["results"][0]["weight_GBps"] is None
    assert format_table(report).splitlines()[0].split()[-2:] == ["p99", "s"]  # the columns end as before


def test_weight_bytes_and_decode_step_rate():
    from specfork.bench.machine import decode_steps_per_s, weight_bytes
    from specfork.layers.linear import DenseLinear

    # pooled over requests: (10 + 20) steps in (10 * 0.1 + 20 * 0.2) s; a one-token request has no TPOT
    metrics = [{"num_generated_tokens": 11, "tpot_s": 0.1}, {"num_generated_tokens": 21, "tpot_s": 0.2},
               {"num_generated_tokens": 1, "tpot_s": None}]
    assert decode_steps_per_s(metrics) == pytest.approx(6.0)
    assert decode_steps_per_s([{"num_generated_tokens": 1, "tpot_s": None}]) is None

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = DenseLinear(torch.zeros(3, 4), torch.zeros(3))
            self.embed_tokens = torch.nn.Embedding(100, 4)
            self.config = type("C", (), {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4})()

    counted = weight_bytes(Tiny())
    assert counted["linear"] == (12 + 3) * 4 and counted["norms"] == 0 and counted["weights"] == 60
    assert counted["kv_per_context_token"] == 2 * 2 * 1 * 4 * 4  # K and V, fp32; the embedding is left out


def test_forward_ms_times_a_forward_after_a_prefilled_context(tiny):
    from specfork import LLM
    from specfork.bench.forward import forward_ms, prefilled

    with LLM(tiny, threads=2, kv_cache_tokens=128) as llm:
        free = llm.engine.block_manager.num_free_blocks
        assert forward_ms(llm, context=8, rows=3, repeat=2, warmup=1) > 0
        with prefilled(llm, context=8, max_rows=2) as forward:
            forward(1)
            forward(2)  # again at the same positions
        assert llm.engine.block_manager.num_free_blocks == free  # the sequence's blocks are given back


@pytest.mark.dist
def test_bench_sweeps_tensor_parallelism_and_the_drafter_rank(tiny, tmp_path, capsys):
    """`--sweep tensor_parallel_size=1,2;ssd_drafter=rank`: every cell runs, greedy output equals AR
    in each, and the TP = 2 runs report their sums (count per forward, time, share)."""
    out = tmp_path / "tp"
    results = _bench_cli(out, "--model", tiny, "--draft", tiny, "--modes", "ar,ssd", "--datasets", "random",
                         "--input-len", "8", "--num-prompts", "1", "--output-len", "8", "--k", "2", "--threads", "1",
                         "--sweep", "tensor_parallel_size=1,2;ssd_drafter=rank", "--warmup", "0")["results"]
    ssd = [r for r in results if r["mode"] == "ssd"]
    assert len(ssd) == 2 and all(r["match_ar"] == 1.0 and r["settings"]["ssd_drafter"] == "rank" for r in ssd)
    tp2 = [r for r in results if r["settings"].get("tensor_parallel_size") == 2]
    assert len(tp2) == 2 and all(r["sums_per_forward"] == 2 * 2 and 0 < r["sum_share"] < 1 for r in tp2)
    assert not any(r.get("sums_per_forward") for r in results if r not in tp2)
    printed = capsys.readouterr().out
    assert "specfork ssd k=2 fan_out=3 backup=jit tp=2 drafter=rank" in printed
    assert "tensor parallel: specfork ar tp=2 input_len=8, random: 4 sums per forward" in printed
    assert "Tensor parallelism" in (out / "results.md").read_text()


def test_configurations_are_timed_interleaved_so_a_drifting_machine_treats_them_alike(monkeypatch):
    """Two identical configurations on a machine that gets slower with every call: timed one after
    the other the second would look 2-3x slower; interleaved group by group (A B, B A, ...) they
    come out level, every group goes through both, and progress counts each."""
    from specfork.bench import measure

    clock = {"calls": 0}
    order = []

    def slowing(fn, group):
        clock["calls"] += 1
        return fn(group), 0.010 * clock["calls"]  # each call 10 ms slower than the one before

    monkeypatch.setattr(measure, "timed", slowing)

    def generator(name):
        def generate(group):
            order.append((name, tuple(map(tuple, group))))
            return [[7] * 4 for _ in group]
        return generate

    prompts = [[1], [2], [3], [4]]
    counted = []
    s = BenchSettings(model="unused", num_prompts=4, repeat=2, batch_size=1)
    out = measure.time_interleaved({"a": generator("a"), "b": generator("b")}, prompts, s,
                                   progress=lambda name, n: counted.append((name, n)))
    assert [name for name, _ in order[:8]] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [group for _, group in order[:4]] == [((1,),), ((1,),), ((2,),), ((2,),)]
    (speeds_a, outputs_a, latencies_a), (speeds_b, _, _) = out["a"], out["b"]
    assert len(speeds_a) == len(speeds_b) == 2 and len(outputs_a) == len(latencies_a) == 4
    for a, b in zip(speeds_a, speeds_b, strict=True):
        assert a / b == pytest.approx(1.0, abs=0.1)
    # The same generators one after the other: the drift shows as a speed difference.
    clock["calls"] = 0
    first = measure.time_interleaved({"a": generator("a")}, prompts, s)["a"][0]
    second = measure.time_interleaved({"b": generator("b")}, prompts, s)["b"][0]
    assert first[0] / second[0] > 2.0
    assert sum(n for _, n in counted) == 2 * 2 * 4


def test_ssd_and_tensor_parallel_modes_are_timed_on_their_own():
    from specfork.bench.runner import interleaved_groups

    s = BenchSettings(model="unused")
    assert interleaved_groups(["ar", "sd", "ssd", "ngram"], s) == (["ar", "sd", "ngram"], [["ssd"]])
    assert interleaved_groups(["ssd"], s) == ([], [["ssd"]])
    assert interleaved_groups(["ar", "sd"], replace(s, tensor_parallel_size=2)) == ([], [["ar"], ["sd"]])


def test_peers_are_timed_interleaved_with_the_modes_but_not_with_ssd(tiny, monkeypatch):
    """The transformers peer's runs go through the same interleaved loop as specfork's AR and
    n-gram modes; SSD's own loop holds SSD alone."""
    from specfork.bench import runner

    calls = []
    real = runner.time_interleaved

    def recording(generators, *args, **kwargs):
        calls.append(list(generators))
        return real(generators, *args, **kwargs)

    monkeypatch.setattr(runner, "time_interleaved", recording)
    settings = _settings(tiny, modes=("ar", "ssd", "ngram"), repeat=1, warmup=0, peers=("transformers",))
    report = run_benchmark(settings, [{}], progress=False)
    assert calls == [["ar", "ngram", "transformers AR", "transformers prompt-lookup", "transformers assisted"],
                     ["ssd"]]
    assert [r["name"] for r in report["results"]] == [
        "specfork ar", "specfork ssd", "specfork ngram", "transformers AR", "transformers prompt-lookup",
        "transformers assisted"]
    assert all(r["tokens"] > 0 for r in report["results"])


def test_machine_info_names_the_commit_that_runs(tmp_path, monkeypatch):
    """The commit of specfork's own checkout (not of the directory the bench runs in), marked
    when its tracked files differ from it."""
    import re
    import subprocess

    from specfork.bench.machine import machine_info

    monkeypatch.chdir(tmp_path)  # not a git checkout
    commit = machine_info()["commit"]
    source = Path(__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=source).stdout.strip()
    if not head:
        pytest.skip("the tests do not run from a git checkout")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=source).stdout.strip()
    assert commit == head + ("+modified" if dirty else "")
    assert re.fullmatch(r"[0-9a-f]{7,}(\+modified)?", commit)


def test_bench_cuda_graphs_script_runs_its_tables(tiny, monkeypatch, capsys):
    """benchmarks/bench_cuda_graphs.py end to end; on the CPU both engines run eagerly (a smoke
    test of the script, not a measurement)."""
    import runpy
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cuda_graphs.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--model", tiny, "--context", "16",
                                      "--max-rows", "3", "--repeat", "2", "--batch-sizes", "1,2",
                                      "--prompt-len", "4", "--output-len", "4", "--repeat-generate", "1"])
    runpy.run_path(str(script), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    steps = lines.index("rows  eager ms  graphs ms  speedup  eager vs 1 row  graphs vs 1 row")
    assert [line.split()[0] for line in lines[steps + 1 : steps + 4]] == ["1", "2", "3"]
    batches = lines.index("batch  eager tok/s  graphs tok/s  speedup  graphs vs batch 1")
    assert [line.split()[0] for line in lines[batches + 1 :]] == ["1", "2"]


def test_a_batch_needs_its_prompts_and_a_dataset_the_prompts_asked_for(tiny):
    """batch=8 rows ran 4 requests together (README's own sweep at the default 4 prompts), and
    --num-prompts past a dataset's split was cut short silently."""
    with pytest.raises(SpecforkError, match="batch_size 8 needs at least that many prompts"):
        _settings(tiny, num_prompts=4, batch_size=8)
    with pytest.raises(SpecforkError, match="batch_size 8 needs"):  # a sweep point is a settings object too
        run_benchmark(_settings(tiny, num_prompts=4), parse_sweep("batch_size=1,8"), progress=False)
    with pytest.raises(SpecforkError, match="--num-prompts 1000: the humaneval evaluation split has 164 prompts"):
        run_benchmark(_settings(tiny, datasets=("humaneval",), num_prompts=1000, input_len=None), [{}], progress=False)
    with pytest.raises(SpecforkError, match="threads must be in 1..1024, got -3"):  # a traceback from torch before
        _settings(tiny, threads=-3)


def test_bench_serve_does_not_count_a_wait_after_its_last_request(monkeypatch):
    """The run's duration is the requests', not the Poisson gap drawn after the last one (which
    halved the reported throughput of a 2-request run)."""
    import asyncio

    from specfork.bench import serve_bench

    async def instant(client, model, body, t0):
        return serve_bench.RequestResult(ok=True, start_s=0.0, output_tokens=1)

    monkeypatch.setattr(serve_bench, "_one", instant)
    _, duration = asyncio.run(serve_bench._run_rate(None, "m", [{}, {}], rate=2.0, seed=0))
    assert 0.93 < duration < 1.2  # seed 0's gaps at rate 2: 0.930 s, then 0.709 s after the last request (not waited)


def test_the_draft_step_ratio_is_the_median_of_side_by_side_pairs(monkeypatch):
    """One pair measured on a busy moment put a head step at 1/11 of a target decode step where
    twelve pairs had a median of 1/19: the bench reports the median ratio of RATIO_PAIRS pairs,
    each draft step divided by the target step measured right after it."""
    import types

    import specfork.bench.runner as runner
    import specfork.speculative.auto_k as auto_k

    # Busy moments slow both halves of a pair (pairs 2-4), one pair is an outlier of its own (5);
    # each draft step is measured, then the target step right after it.
    drafts = [0.25, 0.50, 0.50, 0.50, 0.25, 0.25, 0.40]
    targets = [5.0, 10.0, 10.0, 10.0, 2.5, 5.0, 5.0]
    clock = []
    proposer = types.SimpleNamespace(draft_step_seconds=lambda: clock.append("draft") or drafts[len(clock) // 2])
    llm = types.SimpleNamespace(engine=types.SimpleNamespace(step_strategy=types.SimpleNamespace(proposer=proposer),
                                                             runner=None, block_manager=None))
    monkeypatch.setattr(auto_k, "measure_forward",
                        lambda runner, blocks, rows: clock.append("target") or targets[len(clock) // 2 - 1])
    assert runner.RATIO_PAIRS == 7
    # ratios 0.05 0.05 0.05 0.05 0.1 0.05 0.08: median 0.05; a single pair would say 0.05 by luck, so
    # the ratio of the medians (0.4 / 5 = 0.08) and the mean (0.061) are what this must not return
    assert runner._draft_step_ratio(llm) == pytest.approx(0.05)
    assert clock == ["draft", "target"] * 7
    assert runner._draft_step_ratio(types.SimpleNamespace(engine=types.SimpleNamespace(
        step_strategy=types.SimpleNamespace(proposer=object())))) is None
