"""Turn a ``specfork bench`` report into a printed table, Markdown and PNG plots."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

COLUMNS = ("run", "dataset", "tok/s", "min-max", "vs AR", "accept len", "hit rate", "hidden", "draft/target", "= AR",
           "p50 s", "p99 s")


def _label(r: dict) -> str:
    st = r["settings"]
    extra = {k: st.get(k) for k in ("k", "draft_confidence", "lookup_first", "lookup_corpus", "corpus_tokens",
                                    "fan_out", "backup")}
    if st.get("tensor_parallel_size", 1) != 1:
        extra["tp"] = st["tensor_parallel_size"]
    if st.get("weights"):
        extra["weights"] = st["weights"]
    if st.get("ssd_drafter"):
        extra["drafter"] = st["ssd_drafter"]
    if st.get("batch_size", 1) != 1:
        extra["batch"] = st["batch_size"]
    if st.get("input_len") is not None:
        extra["input_len"] = st["input_len"]
    if st.get("temperature"):
        extra["T"] = st["temperature"]
        if st.get("top_p", 1.0) != 1.0:
            extra["top_p"] = st["top_p"]
        if st.get("top_k"):
            extra["top_k"] = st["top_k"]
    if st.get("device"):
        extra["device"] = st["device"]
    if "cuda_graphs" in st:
        extra["graphs"] = "on" if st["cuda_graphs"] else "off"
    words = [f"{k}={v}" for k, v in extra.items() if v is not None]
    return " ".join([r["name"], *words])


def run_names(rows: list[dict], sweep: list[dict]) -> list[str]:
    """Each row's name in tables and plots: its label, and where the same label has rows at several
    sweep points of one dataset (AR beside each k of a k sweep), the point's overrides after "@"."""
    points = defaultdict(set)
    for r in rows:
        points[(_label(r), r["dataset"])].add(r.get("point", 0))
    names = []
    for r in rows:
        name, point = _label(r), r.get("point", 0)
        if len(points[(name, r["dataset"])]) > 1:
            overrides = {k: v for k, v in (sweep[point] if point < len(sweep) else {}).items() if k != "dataset"}
            name += " @ " + (" ".join(f"{k}={v}" for k, v in overrides.items()) or f"point {point + 1}")
        names.append(name)
    return names


def with_means(report: dict) -> list[dict]:
    """The result rows plus, when several datasets ran, an ``all`` row per run: the mean over
    datasets (as the SSD blog averages its prompt sets)."""
    rows = list(report["results"])
    by_run = defaultdict(list)
    for r in rows:
        by_run[(_label(r), r.get("point", 0))].append(r)
    if len({r["dataset"] for r in rows}) > 1:
        for group in by_run.values():
            if len(group) < 2:
                continue
            mean = dict(group[0])
            mean["dataset"] = "all"
            for key in ("tok_per_s", "tok_per_s_min", "tok_per_s_max"):
                mean[key] = sum(g[key] for g in group) / len(group)
            for key in ("mean_accepted_length", "ssd_cache_hit_rate", "ssd_hidden_fraction", "draft_step_ratio",
                        "match_ar", "weight_GBps"):
                vals = [g[key] for g in group if g.get(key) is not None]
                mean[key] = sum(vals) / len(vals) if vals else None
            mean["latency_s"] = {}
            rows.append(mean)
    return rows


def peer_baselines(report: dict) -> list[str]:
    """Names of the peers' AR runs present: each gets a ratio column."""
    return list(dict.fromkeys(r["name"] for r in report["results"] if r["name"] in ("transformers AR", "llama.cpp AR")))


LEGEND = ("vs AR: tok/s over specfork AR's of the same sweep point and dataset; accept len: tokens per target "
          "forward; hit rate: SSD rounds served from its cache; hidden: share of SSD's drafting hidden behind "
          "verification; draft/target: one draft step over one target decode step; \"= AR\": share of requests "
          "whose tokens equal specfork AR's (greedy runs); p50/p99 s: a request's end-to-end seconds; an \"all\" "
          "row is the mean over the datasets.")
BANDWIDTH_COLUMNS = ("wGB/s", "%bw")  # with --bandwidth: weight bandwidth reached, share of the read bandwidth


def _read_bandwidth(report: dict) -> float | None:
    return report.get("machine", {}).get("read_GBps")


def columns(report: dict) -> list[str]:
    extra = list(BANDWIDTH_COLUMNS) if _read_bandwidth(report) else []
    return list(COLUMNS) + extra + [f"vs {name}" for name in peer_baselines(report)]


def _bandwidth_cells(report: dict, r: dict) -> list[str]:
    read = _read_bandwidth(report)
    if not read:
        return []
    reached = r.get("weight_GBps")
    return ["-", "-"] if reached is None else [f"{reached:.1f}", f"{reached / read:.0%}"]


def _filters(s: dict) -> str:
    """The sampling filters of a sampled run, as the header states them ("" when greedy or off)."""
    if not s.get("temperature"):
        return ""
    return (f", top-p {s['top_p']}" if s.get("top_p", 1.0) != 1.0 else "") + (
        f", top-k {s['top_k']}" if s.get("top_k") else "")


def _workload(r: dict) -> tuple:
    """What a peer's run depends on: dataset, batch size, input and output length, the sampling
    settings."""
    st = r["settings"]
    filters = (st.get("top_p", 1.0), st.get("top_k", 0)) if st.get("temperature") else (1.0, 0)  # unused greedy
    return (r["dataset"], st.get("batch_size", 1), st.get("input_len"), st.get("output_len"),
            st.get("temperature") or 0.0, *filters)


def table_rows(report: dict) -> list[list[str]]:
    rows = with_means(report)
    # Peer columns compare with the peer's AR of the same dataset and sweep point, else of the same
    # workload (batch size, lengths, temperature: the peer runs once for all points sharing them,
    # whatever specfork's own settings), else with the peer's first run on the dataset.
    peers: dict[tuple, float] = {}
    for r in rows:
        if r["name"] in peer_baselines(report):
            peers[(r["name"], r["dataset"], r.get("point", 0))] = r["tok_per_s"]
            peers.setdefault((r["name"], *_workload(r)), r["tok_per_s"])
            peers.setdefault((r["name"], r["dataset"], None), r["tok_per_s"])

    def peer_base(name: str, r: dict) -> float | None:
        for key in ((name, r["dataset"], r.get("point", 0)), (name, *_workload(r)), (name, r["dataset"], None)):
            if key in peers:
                return peers[key]
        return None

    # "vs AR" compares with specfork AR of the same sweep point and dataset (peers: of their point).
    ar = {(r["dataset"], r.get("point", 0)): r["tok_per_s"] for r in rows if r["mode"] == "ar" and r["name"] == "specfork ar"}
    out = []
    for r, name in zip(rows, run_names(rows, report.get("sweep") or [{}]), strict=True):
        base = ar.get((r["dataset"], r.get("point", 0)))
        if base is None:
            base = next((v for (d, _), v in ar.items() if d == r["dataset"]), None)
        out.append([
            name,
            r["dataset"],
            f"{r['tok_per_s']:.2f}",
            f"{r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f}",
            f"{r['tok_per_s'] / base:.2f}x" if base else "-",
            _fmt(r.get("mean_accepted_length")),
            _fmt(r.get("ssd_cache_hit_rate")),
            _fmt(r.get("ssd_hidden_fraction")),
            f"1/{1 / r['draft_step_ratio']:.1f}" if r.get("draft_step_ratio") else "-",
            _match_cell(r),
            _fmt(r.get("latency_s", {}).get("p50")),
            _fmt(r.get("latency_s", {}).get("p99")),
            *_bandwidth_cells(report, r),
            *[f"{r['tok_per_s'] / peer_base(name, r):.2f}x" if peer_base(name, r) else "-"
              for name in peer_baselines(report)],
        ])
    return out


def _match_cell(r: dict) -> str:
    """Share of outputs equal to specfork AR's; "—" on the AR rows, which are the reference."""
    if r.get("match_ar") is not None:
        return f"{r['match_ar']:.0%}"
    return "\u2014" if r["name"] == "specfork ar" else "-"


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(report: dict) -> str:
    rows = [columns(report)] + table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def markdown(report: dict, command: str) -> str:
    m = report["machine"]
    s = report["settings"]
    head = [
        "# specfork bench",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, native kernels {m.get('kernels')}, torch {m['torch']}, "
        f"Python {m['python']}"
        + (f", GPU {m['cuda']}" if m.get("cuda") else "") + f"; commit {m.get('commit')}.",
        "",
        f"{s['num_prompts']} prompts per dataset, {_output_tokens(s)}, temperature "
        f"{s['temperature']}{_filters(s)}, batch size {s['batch_size']}, median of {s['repeat']} run(s) after {s['warmup']} "
        "warm-up run(s). " + LEGEND,
        *_bandwidth_note(report),
        "",
        "| " + " | ".join(columns(report)) + " |",
        "|" + "---|" * len(columns(report)),
    ]
    body = ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    notes = [""] + [f"* {n}" for n in report.get("notes", [])] + _acceptance_lines(report) + _sum_lines(report)
    return "\n".join(head + body + notes) + "\n"


def _acceptance_lines(report: dict) -> list[str]:
    """Acceptance by chain position of every speculative run (accepted / proposed drafts)."""
    lines = [f"* {_label(r)}, {r['dataset']}: " + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
             for r in report["results"] if r.get("acceptance_by_position")]
    out = ["", "Acceptance by chain position (accepted / proposed drafts at positions 1, 2, ...):", *lines] if lines else []
    sources = [f"* {_label(r)}, {r['dataset']}: {source_summary(r['by_source'])}"
               for r in report["results"] if r.get("by_source")]
    if sources:
        out += ["", "Rounds by proposal source (lookup: a repeated n-gram proposed; corpus: the lookup corpus did; "
                "draft: the draft or head did; share of rounds, accepted drafts per round, accepted / proposed):",
                *sources]
    chosen = [f"* {_label(r)}, {r['dataset']}: {auto_k_summary(r['auto_k_rounds'])}"
              for r in report["results"] if r.get("auto_k_rounds")]
    if chosen:
        out += ["", "k auto's decode rounds by k (share of the timed rounds, each plain decode step a round; probe: "
                "one sequence of the batch speculated, the others decoded plainly):", *chosen]
    return out


def auto_k_summary(rounds: dict) -> str:
    """The shares of the rounds, in order of k and probes last: "k=0 94%, k=1 3%, probe 3% (1031 rounds)"."""
    total = sum(rounds.values())
    order = sorted(rounds, key=lambda name: (name == "probe", int(name[2:]) if name != "probe" else 0))
    return ", ".join(f"{name} {rounds[name] / total:.0%}" for name in order) + f" ({total} rounds)"


def source_summary(by_source: dict) -> str:
    """One line for a run's sources, in name order: "draft 59% of rounds, 0.33 accepted per round
    (0.52 of proposed); lookup 41% of rounds, ..." """
    total = sum(c["rounds"] for c in by_source.values()) or 1
    parts = []
    for source, c in sorted(by_source.items()):
        rate = f"{c['accepted'] / c['proposed']:.2f}" if c["proposed"] else "-"
        per_round = c["accepted"] / c["rounds"] if c["rounds"] else 0.0
        parts.append(f"{source} {c['rounds'] / total:.0%} of rounds, {per_round:.2f} accepted per round ({rate} of proposed)")
    return "; ".join(parts)


def sum_lines(report: dict) -> list[str]:
    """The tensor-parallel runs' sums: how many per forward, how long each, their share of the run."""
    return [f"{_label(r)}, {r['dataset']}: {r['sums_per_forward']:.0f} sums per forward, {r['sum_ms']:.2f} ms each, "
            f"{r['sum_share']:.0%} of the run" for r in report["results"] if r.get("sums_per_forward")]


def _sum_lines(report: dict) -> list[str]:
    lines = sum_lines(report)
    return ["", "Tensor parallelism (the ranks' all-gather-and-add after each attention and MLP):",
            *[f"* {line}" for line in lines]] if lines else []


def _output_tokens(s: dict) -> str:
    if s.get("ignore_eos", True):
        return f"{s['output_len']} output tokens (EOS ignored)"
    return f"up to {s['output_len']} output tokens (each request stops at its EOS)"


def legend(report: dict) -> str:
    """What the printed table's columns mean (results.md states the same in its header)."""
    return " ".join([LEGEND, *_bandwidth_note(report)[1:]])


def _bandwidth_note(report: dict) -> list[str]:
    read = _read_bandwidth(report)
    if not read:
        return []
    return ["", f"Read bandwidth of this machine: {read:.1f} GB/s (the higher of before and after the runs). "
            "wGB/s: weight bytes read per decode step x decode steps/s (from TPOT; specfork AR runs at batch 1); "
            "%bw: its share of the read bandwidth."]


def _number(cell: str) -> float | None:
    return float(cell.rstrip("x")) if cell not in ("-", "") else None


def chart_series(rows: list[list[str]], col: int) -> tuple[list[str], dict[tuple[str, str], float | None]]:
    """The runs that have a value in table column ``col`` (in any dataset), and every (run,
    dataset) value of that column."""
    values = {(r[0], r[1]): _number(r[col]) for r in rows}
    return list(dict.fromkeys(run for (run, _), v in values.items() if v is not None)), values


def plots(report: dict, directory: Path) -> list[Path]:
    """Bar charts: tok/s, speedup over AR, accepted length, SSD hit rate, latency p50/p99. A chart
    shows only the runs that have its metric (no AR bar in accepted length) and is written only
    when some run has it (no SSD hit-rate chart without SSD); every bar is labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table_rows(report)
    datasets = list(dict.fromkeys(r[1] for r in rows))
    charts = {
        "tok_per_s": ("tok/s", "tokens/s", "generated tokens per second"),
        "speedup": ("vs AR", "speedup over specfork AR", "x specfork AR"),
        "accepted_length": ("accept len", "mean accepted length", "tokens per target forward"),
        "ssd_hit_rate": ("hit rate", "SSD cache hit rate", "share of rounds served from the cache"),
        "latency_p50": ("p50 s", "end-to-end latency p50", "seconds per request"),
        "latency_p99": ("p99 s", "end-to-end latency p99", "seconds per request"),
    }
    written = []
    for name, (column, title, unit) in charts.items():
        runs, values = chart_series(rows, COLUMNS.index(column))
        for stale in directory.glob(f"{name}.png"):
            stale.unlink()  # a chart from an earlier run in this directory would be misread as this run's
        if not runs:
            continue
        fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(runs) * max(1, len(datasets)) / 2), 4.5))
        width = 0.8 / max(1, len(datasets))
        for d_index, dataset in enumerate(datasets):
            heights = [values.get((run, dataset)) for run in runs]
            bars = ax.bar([i + d_index * width for i in range(len(runs))], [h or 0.0 for h in heights], width,
                          label=dataset)
            ax.bar_label(bars, labels=["" if h is None else f"{h:.3g}" for h in heights], fontsize=7, padding=2)
        ax.set_xticks([i + width * (len(datasets) - 1) / 2 for i in range(len(runs))])
        ax.set_xticklabels(runs, rotation=25, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.set_xlabel("run")
        ax.margins(y=0.15)
        ax.legend(title="dataset", fontsize=8)
        fig.tight_layout()
        path = directory / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_all(report: dict, directory: Path, command: str) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    report = {**report, "command": command}
    paths = {"json": directory / "results.json", "markdown": directory / "results.md"}
    paths["json"].write_text(json.dumps(report, indent=2, default=str))
    paths["markdown"].write_text(markdown(report, command))
    for plot in plots(report, directory):
        paths[plot.stem] = plot
    return paths
