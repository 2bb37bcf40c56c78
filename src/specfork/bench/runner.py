"""``specfork bench``: AR / SD / SSD / n-gram runs over prompt sets, side by side with peers.

Every run records the machine, the exact command and the commit; greedy speculative runs are
checked token for token against AR (the match rate is printed); warm-up runs are excluded;
throughput is the median over ``repeat`` runs, with min and max. A sweep point's modes and peers
(SSD and tensor parallelism aside) are loaded together and timed interleaved, prompt group by
prompt group, so that their ratios do not depend on when each ran on a shared machine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, replace
from functools import partial

import torch

from specfork.bench.machine import decode_steps_per_s, machine_info, read_bandwidth, weight_bytes
from specfork.bench.measure import Progress, RunResult, throughput, time_interleaved
from specfork.bench.peers import peer_runs
from specfork.bench.peers.common import GenerateGroup, PeerRun, peer_result, warm_up
from specfork.bench.settings import SWEEPABLE, BenchSettings
from specfork.bench.timing import median, percentiles
from specfork.config import DEFAULT_DECODE_STEPS, Config
from specfork.errors import SpecforkError

logger = logging.getLogger(__name__)


def parse_sweep(spec: str | None) -> list[dict]:
    """``"k=2,3,5;fan_out=1,3"`` → one override dict per point of the grid (one axis at a time
    would hide interactions, a full grid is what a sweep means)."""
    if not spec:
        return [{}]
    axes = []
    for part in spec.split(";"):
        if "=" not in part:
            raise SpecforkError(f"sweep part {part!r}: expected name=v1,v2")
        name, values = part.split("=", 1)
        name = name.strip()
        if name not in SWEEPABLE:
            raise SpecforkError(f"cannot sweep {name!r}; sweepable: {', '.join(SWEEPABLE)}")
        if any(axis[0][0] == name for axis in axes):
            raise SpecforkError(f"sweep {name}: given twice; list its values once, e.g. {name}=2,3")
        try:
            axes.append([(name, SWEEPABLE[name](v)) for v in values.split(",")])
        except ValueError:
            raise SpecforkError(f"sweep {name}: bad value in {values!r}") from None
    grid = [{}]
    for axis in axes:
        grid = [{**point, name: value} for point in grid for name, value in axis]
    return grid


def check_prompt_counts(points: list[BenchSettings]) -> None:
    """Every dataset holds the prompts asked of it (a dataset's split was cut short silently, and
    the report said how many had been asked for)."""
    from specfork.datasets import load_prompts

    available: dict[str, int] = {}  # each split counted once, however many points ask for it
    for s in points:
        for dataset in s.datasets:
            if dataset == "random":
                continue
            if dataset not in available:
                available[dataset] = len(load_prompts(dataset, "eval"))
            if available[dataset] < s.num_prompts:
                raise SpecforkError(f"--num-prompts {s.num_prompts}: the {dataset} evaluation split has "
                                    f"{available[dataset]} prompts")


def check_sampling_filters(points: list[BenchSettings]) -> None:
    """top-p and top-k filter sampled runs only: given where every point is greedy, they would be
    ignored (a sweep of top_p at temperature 0 ran the same greedy runs once per value)."""
    if all(s.temperature == 0 for s in points):
        for name, off in (("top_p", 1.0), ("top_k", 0)):
            if any(getattr(s, name) != off for s in points):
                raise SpecforkError(f"{name} filters sampling at temperature > 0, and every run here is greedy "
                                    "(temperature 0): give --temperature, or leave " + name + " out")


def load_prompt_ids(llm, dataset: str, settings: BenchSettings) -> list[list[int]]:
    from specfork.datasets import encode, load_prompts, random_token_prompts

    if dataset == "random":
        return random_token_prompts(settings.num_prompts, settings.input_len, llm.vocab_size,
                                    seed=settings.seed)
    ids = [encode(llm, p) for p in load_prompts(dataset, "eval", settings.num_prompts)]
    if settings.input_len is not None:
        # Keep the end of long prompts (where generation continues); repeat short ones to length.
        ids = [(p * -(-settings.input_len // len(p)))[-settings.input_len :] for p in ids]
    return ids


def _engine_options(mode: str, s: BenchSettings) -> dict:
    # No prefix caching: the warm-up and every repeat run the same prompts, which would then skip
    # their prefill in AR and not under an EAGLE-3 head (which cannot use the cache).
    options = {"threads": s.threads, "max_num_seqs": max(s.batch_size, 1), "tensor_parallel_size": s.tensor_parallel_size,
               "weights": s.weights, "device": s.device, "cuda_graphs": s.cuda_graphs, "prefix_caching": False}
    if mode == "sd":
        options.update(mode="sd", draft=s.draft, k=s.k, draft_confidence=s.draft_confidence,
                       lookup_first=s.lookup_first)
        config = Config(model=s.model, **options)
        if config.prompt_lookup:
            options.update(lookup_corpus=s.lookup_corpus, corpus_tokens=s.corpus_tokens)
    elif mode == "ngram":
        options.update(mode="sd", drafter="ngram", k=s.k, lookup_corpus=s.lookup_corpus,
                       corpus_tokens=s.corpus_tokens)
    elif mode == "ssd":
        options.update(mode="ssd", draft=s.draft, k=s.k, fan_out=s.fan_out, backup=s.backup, threads=None,
                       target_cores=s.target_cores, draft_cores=s.draft_cores,
                       drafter_rank=s.tensor_parallel_size if s.ssd_drafter == "rank" else None)
    if _takes_decode_steps(mode, s):
        options.update(decode_steps=s.decode_steps)
    return options


def _takes_decode_steps(mode: str, s: BenchSettings) -> bool:
    """Whether a run of ``mode`` reads --decode-steps: AR, and SD's plain rounds at k auto."""
    return mode == "ar" or (mode in ("sd", "ngram") and (s.k is None or s.k == "auto"))


def run_interleaved(modes: list[str], dataset: str, prompts: list[list[int]], s: BenchSettings,
                 progress: Progress | None = None,
                 peers: Sequence[PeerRun] = ()) -> tuple[list[tuple[RunResult, list]], list[tuple[RunResult, list]]]:
    """Each of ``modes`` with its own engine, and each of ``peers``, all loaded together and timed
    interleaved (:func:`time_interleaved`); (result, output token ids) per mode and per peer, in
    order."""
    from specfork import LLM, SamplingParams

    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.output_len,
                            ignore_eos=s.ignore_eos, seed=s.seed)
    with ExitStack() as stack:
        llms = {mode: stack.enter_context(LLM(s.model, **_engine_options(mode, s))) for mode in modes}
        for llm in llms.values():
            for _ in range(s.warmup):
                for group, group_params in warm_up_groups(prompts, params, s):
                    llm.generate(group, group_params)
            if llm.engine.parallel is not None:
                llm.engine.parallel.collectives.reset()
            if (auto_k := _auto_k(llm)) is not None:
                auto_k.rounds_by_k.clear()  # count the timed rounds only
        loaded = {run.name: stack.enter_context(run.open()) for run in peers}
        for generate_group in loaded.values():
            warm_up(generate_group, prompts, s)
        generators = {mode: partial(_generate, llm, params) for mode, llm in llms.items()}
        generators |= {name: partial(_generate_peer, generate_group, s.output_len)
                       for name, generate_group in loaded.items()}
        timings = time_interleaved(generators, prompts, s, count=_token_count, progress=progress)
        return ([_result(mode, dataset, s, llms[mode], *timings[mode][:2]) for mode in modes],
                [peer_result(run, dataset, s, *timings[run.name]) for run in peers])


def warm_up_groups(prompts: list[list[int]], params, s: BenchSettings) -> list[tuple[list[list[int]], object]]:
    """The (prompts, params) of one untimed warm-up run of a specfork engine. On the CPU: the first
    group for 16 tokens (what loads lazily is loaded). On CUDA: every group to its full length, as
    a timed run goes, so that the CUDA graphs of the windows and key buckets the timed runs meet
    are captured before them: each capture takes ~45 ms (about 14 decode steps of the embedded model
    on an H200), and after a 16-token warm-up those of a 4-prompt run fell in the timed run, 8-14
    rounds and 12-22% of SD's time (docs/benchmarks.md)."""
    if s.device.startswith("cuda"):
        return [(prompts[i : i + s.batch_size], params) for i in range(0, len(prompts), s.batch_size)]
    return [(prompts[: s.batch_size], replace(params, max_tokens=min(16, s.output_len)))]


def _generate(llm, params, group: list[list[int]]) -> list:
    return llm.generate(group, params)


def _generate_peer(generate_group: GenerateGroup, new_tokens: int, group: list[list[int]]) -> list[list[int]]:
    return generate_group(group, new_tokens)


def _token_count(output) -> int:
    """Tokens of one output: a specfork RequestOutput, or a peer's list of token ids."""
    return len(output.token_ids) if hasattr(output, "token_ids") else len(output)


def _result(mode: str, dataset: str, s: BenchSettings, llm, speeds: list[float], outputs: list) -> tuple[RunResult, list]:
    """The cell of ``mode``: its timed passes and what its engine measured (while it is loaded)."""
    from specfork.outputs import aggregate_metrics

    sums = _sums(llm.engine.parallel, sum(len(o.token_ids) for o in outputs), speeds)
    # At batch 1 only: in a batch, a request's TPOT also holds the other requests' prefills.
    reads_weights = s.bandwidth and mode == "ar" and s.batch_size == 1
    step_bytes = weight_bytes(llm.engine.loaded.model)["weights"] if reads_weights else None
    agg = aggregate_metrics(outputs)
    result = RunResult(
        name=f"specfork {mode}",
        mode=mode,
        dataset=dataset,
        settings=_cell_settings(mode, s),
        **throughput(speeds),
        tokens=agg["num_generated_tokens"],
        mean_accepted_length=agg.get("mean_accepted_length"),
        ssd_cache_hit_rate=agg.get("ssd_cache_hit_rate"),
        acceptance_by_position=agg.get("acceptance_by_position"),
        by_source=agg.get("by_source"),
        draft_step_ratio=_draft_step_ratio(llm) if mode == "sd" else None,
        auto_k_rounds=dict(sorted(auto_k.rounds_by_k.items())) if (auto_k := _auto_k(llm)) is not None else None,
        ssd_hidden_fraction=agg.get("ssd_hidden_fraction"),
        latency_s=percentiles([o.metrics["time_s"] for o in outputs]),
        ttft_s=percentiles([o.metrics["ttft_s"] for o in outputs if o.metrics.get("ttft_s") is not None]),
        **sums,
    )
    steps_per_s = decode_steps_per_s([o.metrics for o in outputs]) if step_bytes else None
    if steps_per_s:
        result.weight_GBps = step_bytes * steps_per_s / 1e9
    return result, [o.token_ids for o in outputs]


def interleaved_groups(modes: list[str], s: BenchSettings) -> tuple[list[str], list[list[str]]]:
    """(the modes timed together, with the peers; the modes timed each on its own): every mode
    but SSD together (SSD pins the process to its target's cores while its drafter runs, and the
    drafter takes the others); under tensor parallelism every mode alone (one torch.distributed
    world per process), and the peers then with no mode."""
    together = [m for m in modes if m != "ssd"] if s.tensor_parallel_size == 1 else []
    return together, [[m] for m in modes if m not in together]


def _sums(parallel, tokens: int, speeds: list[float]) -> dict:
    """Tensor parallelism: the ranks' sums per forward and their share of the timed passes."""
    if parallel is None:
        return {}
    c = parallel.collectives
    wall = sum(tokens / speed for speed in speeds)
    return {"sums_per_forward": c.reduce_calls / max(c.forwards, 1), "sum_ms": c.mean_reduce_ms,
            "sum_share": c.reduce_seconds / wall if wall else None}


def _auto_k(llm):
    """The engine's ``--k auto`` planner, or None."""
    return getattr(llm.engine.step_strategy, "auto_k", None)


RATIO_PAIRS = 7  # side-by-side measurements of a draft step and a target decode step


def _draft_step_ratio(llm) -> float | None:
    """One draft step (a draft model's forward, or an EAGLE-3 head step) over one target decode
    step, both of one token after a 64-token context: the median of RATIO_PAIRS ratios, each of
    the two measured side by side (single pairs on this shared machine ranged from 1/11 to 1/23)."""
    from specfork.speculative.auto_k import measure_forward

    proposer = llm.engine.step_strategy.proposer
    if not hasattr(proposer, "draft_step_seconds"):
        return None
    ratios = [proposer.draft_step_seconds() / measure_forward(llm.engine.runner, llm.engine.block_manager, 1)
              for _ in range(RATIO_PAIRS)]
    return median(ratios)


def _cell_settings(mode: str, s: BenchSettings) -> dict:
    keep = {"output_len", "temperature", "top_p", "top_k", "batch_size", "input_len"}
    if mode != "ar":
        keep |= {"k"}
    shown = {}
    config = Config(model=s.model, **_engine_options(mode, s)) if mode != "ar" else None
    if config is not None:  # the settings the engine runs with (its defaults resolved)
        shown["k"] = config.k
    if mode == "sd":
        shown |= {"draft_confidence": config.head_confidence, "lookup_first": config.lookup_first_n}
        keep |= {name for name, value in shown.items() if value}
    if config is not None and config.prompt_lookup:  # which corpus the lookup searches, by name ("none" for none)
        from specfork.loading.resolve import resolve_checkpoint, resolve_corpus

        corpus = resolve_corpus(config.lookup_corpus, resolve_checkpoint(s.model))
        shown["lookup_corpus"] = corpus.stem if corpus is not None else "none"
        keep |= {"lookup_corpus"}
        if corpus is not None:
            shown["corpus_tokens"] = config.corpus_tokens
            keep |= {"corpus_tokens"}
    if mode == "ssd":
        keep |= {"fan_out", "backup"} | ({"ssd_drafter"} if s.ssd_drafter != "process" else set())
    if s.tensor_parallel_size != 1:
        keep |= {"tensor_parallel_size"}
    if s.weights != "native":
        keep |= {"weights"}
    if _takes_decode_steps(mode, s) and s.decode_steps != DEFAULT_DECODE_STEPS:
        keep |= {"decode_steps"}
    if s.device != "cpu":
        keep |= {"device", "cuda_graphs"}
    return {k: v for k, v in (asdict(s) | shown).items() if k in keep}


def run_benchmark(settings: BenchSettings, sweep: list[dict], progress: bool = True) -> dict:
    """Run every (sweep point, dataset, mode) cell plus peers; returns the JSON-able report."""
    from tqdm import tqdm

    from specfork import LLM

    for name in dict.fromkeys(name for point in sweep for name in point):
        settings.check_read(name, f"--sweep {name}")
        given = getattr(settings, name, None)
        required = name == "input_len" and "random" in settings.datasets  # the random dataset needs one
        if name != "dataset" and not required and given != BenchSettings.__dataclass_fields__[name].default:
            raise SpecforkError(f"--sweep {name} would replace --{name.replace('_', '-')} {given}: give its values "
                                "in the sweep only")
    # Each point's settings, validated before anything runs (a point's dataset is its only one).
    points = [(replace(settings, **{k: v for k, v in p.items() if k != "dataset"},
                       **({"datasets": (p["dataset"],)} if "dataset" in p else {})), p) for p in sweep]
    check_prompt_counts([s for s, _ in points])
    check_sampling_filters([s for s, _ in points])
    if settings.threads:
        torch.set_num_threads(settings.threads)
    bandwidth = {"before": read_bandwidth()} if settings.bandwidth else None
    cells = [(i, pt, d) for i, (pt, p) in enumerate(points)
             for d in ([p["dataset"]] if "dataset" in p else pt.datasets)]
    prompt_sets: dict[tuple, list[list[int]]] = {}
    with LLM(settings.model, threads=settings.threads) as probe:
        for _, pt, dataset in cells:
            key = (dataset, pt.input_len, pt.num_prompts)
            if key not in prompt_sets:
                prompt_sets[key] = load_prompt_ids(probe, dataset, pt)
    total = sum(len(prompt_sets[(d, pt.input_len, pt.num_prompts)]) * len(_run_order(pt)) * pt.repeat
                for _, pt, d in cells)
    bar = tqdm(total=total, desc="bench", unit="req", disable=not progress)
    results: list[RunResult] = []
    notes: list[str] = []
    peers_done: set[tuple] = set()
    for index, point, dataset in cells:
        prompts = prompt_sets[(dataset, point.input_len, point.num_prompts)]
        greedy = point.temperature == 0
        order = _run_order(point)
        reference = None
        peers = []
        for peer in point.peers:  # peers do not depend on k, fan-out or the draft: run them once
            filters = (point.top_p, point.top_k) if point.temperature > 0 else ()  # greedy runs ignore them
            key = (peer, dataset, point.input_len, point.output_len, point.temperature, *filters, point.batch_size)
            if key not in peers_done:
                peers_done.add(key)
                peers += peer_runs(peer, prompts, point, lambda text: _note(notes, text))
        if peers:  # known only now (a peer runs once per workload, and only where it is installed)
            bar.total += len(prompts) * point.repeat * len(peers)
            bar.refresh()
        together, alone = interleaved_groups(order, point)
        cell: dict[str, RunResult] = {}
        peer_cells: list[tuple[RunResult, list]] = []
        for group, group_peers in [(together, peers), *((g, []) for g in alone)]:
            if not group and not group_peers:
                continue
            timed_cells, timed_peers = run_interleaved(group, dataset, prompts, point,
                                                       lambda _, requests: bar.update(requests), group_peers)
            peer_cells += timed_peers
            for mode, (result, tokens) in zip(group, timed_cells, strict=True):
                if mode == "ar":
                    reference = tokens
                if greedy and mode != "ar":  # AR is the reference: comparing it with itself says nothing
                    result.match_ar = _match_rate(tokens, reference)
                result.point = index
                cell[mode] = result
        results.extend(cell[mode] for mode in order if mode in point.modes)
        for result, tokens in peer_cells:
            if greedy:
                result.match_ar = _match_rate(tokens, reference)
            result.point = index
            results.append(result)
    bar.close()
    machine = machine_info()
    if bandwidth is not None:  # the machine's bandwidth varies from one minute to the next: keep the higher
        bandwidth["after"] = read_bandwidth()
        machine["read_GBps"] = max(bandwidth["before"]["read_GBps"], bandwidth["after"]["read_GBps"])
        machine["bandwidth"] = bandwidth
    return {
        "machine": machine,
        "settings": asdict(settings),
        "sweep": sweep,
        "results": [asdict(r) for r in results],
        "notes": notes,
    }


def _run_order(point: BenchSettings) -> list[str]:
    """The modes a point runs, AR first: greedy runs are checked against AR, so AR runs even when
    it is not reported (and counts on the progress bar, which shows the work left)."""
    return (["ar"] if point.temperature == 0 or "ar" in point.modes else []) + [m for m in point.modes if m != "ar"]


def _match_rate(tokens: list[list[int]], reference: list[list[int]] | None) -> float | None:
    if reference is None:
        return None
    return sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(tokens)


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
        logger.warning(text)
