"""``specfork bench``: AR / SD / SSD / n-gram runs over prompt sets, side by side with peers.

Every run records the machine, the exact command and the commit; greedy speculative runs are
checked token for token against AR (the match rate is printed); warm-up runs are excluded;
throughput is the median over ``repeat`` runs, with min and max.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field, replace

import torch

from specfork.bench.settings import SWEEPABLE, BenchSettings
from specfork.bench.timing import clock, median, percentiles
from specfork.errors import SpecforkError

logger = logging.getLogger(__name__)

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
        try:
            axes.append([(name, SWEEPABLE[name](v)) for v in values.split(",")])
        except ValueError:
            raise SpecforkError(f"sweep {name}: bad value in {values!r}") from None
    grid = [{}]
    for axis in axes:
        grid = [{**point, name: value} for point in grid for name, value in axis]
    return grid


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": commit or None,
    }


def load_prompt_ids(llm, dataset: str, settings: BenchSettings) -> list[list[int]]:
    from specfork.datasets import encode, load_prompts, random_token_prompts

    if dataset == "random":
        return random_token_prompts(settings.num_prompts, settings.input_len, llm.engine.loaded.arch.vocab_size,
                                    seed=settings.seed)
    ids = [encode(llm, p) for p in load_prompts(dataset, "eval", settings.num_prompts)]
    if settings.input_len is not None:
        # Keep the end of long prompts (where generation continues); repeat short ones to length.
        ids = [(p * -(-settings.input_len // len(p)))[-settings.input_len :] for p in ids]
    return ids


def _engine_options(mode: str, s: BenchSettings) -> dict:
    options = {"threads": s.threads, "max_num_seqs": max(s.batch_size, 1)}
    if mode == "sd":
        options.update(mode="sd", draft=s.draft, k=s.k)
    elif mode == "ngram":
        options.update(mode="sd", drafter="ngram", k=s.k)
    elif mode == "ssd":
        options.update(mode="ssd", draft=s.draft, k=s.k, fan_out=s.fan_out, backup=s.backup, threads=None,
                       target_cores=s.target_cores, draft_cores=s.draft_cores)
    return options


def run_specfork(mode: str, dataset: str, prompts: list[list[int]], s: BenchSettings, progress=None) -> tuple[RunResult, list]:
    from specfork import LLM, SamplingParams
    from specfork.outputs import aggregate_metrics

    params = SamplingParams(temperature=s.temperature, max_tokens=s.output_len, ignore_eos=True, seed=s.seed)
    with LLM(s.model, **_engine_options(mode, s)) as llm:
        for _ in range(s.warmup):
            llm.generate(prompts[: s.batch_size], replace(params, max_tokens=min(16, s.output_len)))
        speeds, outputs = [], []
        for _ in range(s.repeat):
            outputs = []
            start = clock()
            for i in range(0, len(prompts), s.batch_size):
                outputs.extend(llm.generate(prompts[i : i + s.batch_size], params))
                if progress is not None:
                    progress.update(len(prompts[i : i + s.batch_size]))
            speeds.append(sum(len(o.token_ids) for o in outputs) / (clock() - start))
    agg = aggregate_metrics(outputs)
    result = RunResult(
        name=f"specfork {mode}",
        mode=mode,
        dataset=dataset,
        settings=_cell_settings(mode, s),
        tok_per_s=median(speeds),
        tok_per_s_min=min(speeds),
        tok_per_s_max=max(speeds),
        tokens=agg["num_generated_tokens"],
        mean_accepted_length=agg.get("mean_accepted_length"),
        ssd_cache_hit_rate=agg.get("ssd_cache_hit_rate"),
        latency_s=percentiles([o.metrics["time_s"] for o in outputs]),
        ttft_s=percentiles([o.metrics["ttft_s"] for o in outputs if o.metrics.get("ttft_s") is not None]),
    )
    return result, [o.token_ids for o in outputs]


def _cell_settings(mode: str, s: BenchSettings) -> dict:
    keep = {"output_len", "temperature", "batch_size", "input_len"}
    if mode != "ar":
        keep |= {"k"}
    if mode == "ssd":
        keep |= {"fan_out", "backup"}
    return {k: v for k, v in asdict(s).items() if k in keep}


def run_transformers(kind: str, dataset: str, prompts: list[list[int]], s: BenchSettings) -> tuple[RunResult, list]:
    """transformers ``generate`` at batch 1: AR, prompt lookup or assisted (same draft)."""
    from transformers import AutoModelForCausalLM

    from specfork.loading.resolve import resolve_checkpoint, resolve_draft

    def load(name: str):
        path = resolve_checkpoint(name).path
        if path.is_dir():
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    target_location = resolve_checkpoint(s.model)
    model = load(s.model)
    kwargs = dict(do_sample=s.temperature > 0, max_new_tokens=s.output_len, min_new_tokens=s.output_len,
                  pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    if s.temperature > 0:
        kwargs["temperature"] = s.temperature
    if kind == "prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif kind == "assisted":
        kwargs["assistant_model"] = load(resolve_draft(s.draft, target_location))

    def generate(ids: list[int], n: int) -> list[int]:
        extra = {} if n == s.output_len else {"max_new_tokens": n, "min_new_tokens": n}
        return model.generate(torch.tensor([ids]), **{**kwargs, **extra})[0, len(ids) :].tolist()

    def generate_group(group: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(ids) for ids in group)  # left padding, as transformers expects for generation
        ids = torch.tensor([[kwargs["pad_token_id"]] * (width - len(g)) + g for g in group])
        mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
        extra = {"max_new_tokens": n, "min_new_tokens": n}
        return model.generate(ids, attention_mask=mask, **{**kwargs, **extra})[:, width:].tolist()

    with torch.inference_mode():
        group_generate = generate_group if s.batch_size > 1 else _one_at_a_time(generate)
        return _time_peer(f"transformers {kind}", kind, dataset, prompts, s, group_generate)


def run_llama_cpp(kind: str, dataset: str, prompts: list[list[int]], s: BenchSettings) -> tuple[RunResult, list]:
    """llama.cpp (llama-cpp-python) on the same GGUF: AR, or prompt lookup (its Python API has no
    model-draft speculation). Greedy (top_k 1), EOS ignored, same thread count."""
    from llama_cpp import Llama

    from specfork.loading.resolve import resolve_checkpoint

    path = str(resolve_checkpoint(s.model).path)
    kwargs = {}
    if kind == "prompt-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=10)
    n_ctx = max(len(p) for p in prompts) + s.output_len + 16
    threads = s.threads or torch.get_num_threads()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False, **kwargs)

    def generate(ids: list[int], n: int) -> list[int]:
        out = []
        for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == n:
                break
        return out

    return _time_peer(f"llama.cpp {kind}", kind, dataset, prompts, s, _one_at_a_time(generate))


def run_llama_cpp_batched(kind: str, dataset: str, prompts: list[list[int]], s: BenchSettings) -> tuple[RunResult, list]:
    """llama.cpp AR (``kind``) with its own parallel decoding: the low-level batch API with one
    sequence id per request (as its server's slots and ``llama-batched`` do), ``batch_size``
    requests at a time, greedy, EOS ignored, same thread count. llama-cpp-python's ``Llama``
    class decodes one sequence only."""
    import llama_cpp as lc
    import numpy as np

    from specfork.loading.resolve import resolve_checkpoint

    path = str(resolve_checkpoint(s.model).path)
    threads = s.threads or torch.get_num_threads()
    per_seq = max(len(p) for p in prompts) + s.output_len + 16
    try:  # the low-level API logs every graph it builds; keep errors only, as Llama(verbose=False) does
        from llama_cpp._logger import set_verbose

        set_verbose(False)
    except ImportError:
        pass
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx = s.batch_size * per_seq
    params.n_batch = params.n_ubatch = max(per_seq, s.batch_size)
    params.n_seq_max = s.batch_size
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(max(per_seq, s.batch_size), 0, s.batch_size)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(row: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).argmax())

    def generate_group(group: list[list[int]], n: int) -> list[list[int]]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        outputs = []
        for seq, ids in enumerate(group):  # prefill each request into its own sequence
            decode([(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)])
            outputs.append([argmax(len(ids) - 1)])
        while len(outputs[0]) < n:  # one batched decode per step, every sequence advancing
            decode([(out[-1], len(ids) + len(out) - 1, seq, True)
                    for seq, (ids, out) in enumerate(zip(group, outputs, strict=True))])
            for seq, out in enumerate(outputs):
                out.append(argmax(seq))
        return outputs

    try:
        return _time_peer(f"llama.cpp {kind}", kind, dataset, prompts, s, generate_group)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def _time_peer(name: str, kind: str, dataset: str, prompts: list[list[int]], s: BenchSettings,
               generate_group) -> tuple[RunResult, list]:
    """Warm up, then time ``generate_group(prompts[i : i + batch_size], output_len)`` over the prompts
    ``repeat`` times (as specfork's runs are timed); a request's latency is its group's."""
    for _ in range(s.warmup):
        generate_group(prompts[: s.batch_size], 8)
    speeds, outputs, latencies = [], [], []
    for _ in range(s.repeat):
        outputs, latencies = [], []
        start = clock()
        for i in range(0, len(prompts), s.batch_size):
            t0 = clock()
            group = generate_group(prompts[i : i + s.batch_size], s.output_len)
            outputs.extend(group)
            latencies.extend([clock() - t0] * len(group))
        speeds.append(sum(len(o) for o in outputs) / (clock() - start))
    settings = {"output_len": s.output_len, **({"batch_size": s.batch_size} if s.batch_size > 1 else {})}
    result = RunResult(
        name=name, mode=kind, dataset=dataset, settings=settings,
        tok_per_s=median(speeds), tok_per_s_min=min(speeds), tok_per_s_max=max(speeds),
        tokens=sum(len(o) for o in outputs), latency_s=percentiles(latencies),
    )
    return result, outputs


def _one_at_a_time(generate):
    """A peer's single-sequence ``generate(ids, n)`` as a ``generate_group`` for ``_time_peer``."""
    return lambda group, n: [generate(ids, n) for ids in group]




def llama_cpp_missing(settings: BenchSettings) -> str | None:
    import importlib.util

    from specfork.loading.resolve import CheckpointFormat, resolve_checkpoint

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (optional peer: pip install llama-cpp-python, builds from source)"
    if resolve_checkpoint(settings.model).format is not CheckpointFormat.GGUF:
        return f"{settings.model} is not a GGUF file"
    if settings.temperature > 0:
        return "llama.cpp peer runs are greedy only"
    return None


def run_benchmark(settings: BenchSettings, sweep: list[dict], progress: bool = True) -> dict:
    """Run every (sweep point, dataset, mode) cell plus peers; returns the JSON-able report."""
    from tqdm import tqdm

    from specfork import LLM

    if settings.threads:
        torch.set_num_threads(settings.threads)
    points = [(replace(settings, **{k: v for k, v in p.items() if k != "dataset"}), p) for p in sweep]
    cells = [(i, pt, d) for i, (pt, p) in enumerate(points)
             for d in ([p["dataset"]] if "dataset" in p else pt.datasets)]
    prompt_sets: dict[tuple, list[list[int]]] = {}
    with LLM(settings.model, threads=settings.threads) as probe:
        for _, pt, dataset in cells:
            key = (dataset, pt.input_len, pt.num_prompts)
            if key not in prompt_sets:
                prompt_sets[key] = load_prompt_ids(probe, dataset, pt)
    total = sum(len(prompt_sets[(d, pt.input_len, pt.num_prompts)]) * len(pt.modes) * pt.repeat for _, pt, d in cells)
    bar = tqdm(total=total, desc="bench", unit="req", disable=not progress)
    results: list[RunResult] = []
    notes: list[str] = []
    peers_done: set[tuple] = set()  # peers do not depend on k, fan-out or the draft: run them once
    for index, point, dataset in cells:
        prompts = prompt_sets[(dataset, point.input_len, point.num_prompts)]
        greedy = point.temperature == 0
        # Greedy runs are checked against AR, so AR runs first even when it is not reported.
        order = (["ar"] if greedy or "ar" in point.modes else []) + [m for m in point.modes if m != "ar"]
        reference = None
        for mode in order:
            reported = mode in point.modes
            result, tokens = run_specfork(mode, dataset, prompts, point, bar if reported else None)
            if mode == "ar":
                reference = tokens
            if greedy and mode != "ar":  # AR is the reference: comparing it with itself says nothing
                result.match_ar = _match_rate(tokens, reference)
            result.point = index
            if reported:
                results.append(result)
        for peer in point.peers:
            key = (peer, dataset, point.input_len, point.output_len, point.temperature, point.batch_size)
            if key in peers_done:
                continue
            peers_done.add(key)
            if peer == "llama.cpp":
                reason = llama_cpp_missing(point)
                if reason is not None:
                    _note(notes, f"skipping llama.cpp: {reason}")
                    continue
                for kind in ("AR", "prompt-lookup") if point.batch_size == 1 else ("AR",):
                    run = run_llama_cpp if point.batch_size == 1 else run_llama_cpp_batched
                    result, tokens = run(kind, dataset, prompts, point)
                    if greedy:
                        result.match_ar = _match_rate(tokens, reference)
                    result.point = index
                    results.append(result)
                _note(notes, "llama.cpp: llama-cpp-python has no draft-model speculation API; AR and prompt lookup only")
                continue
            if point.batch_size != 1:
                _note(notes, "transformers: batched runs are AR only (prompt lookup and assisted generation take one sequence)")
            for kind in ("AR", "prompt-lookup", "assisted") if point.batch_size == 1 else ("AR",):
                result, tokens = run_transformers(kind, dataset, prompts, point)
                if greedy:
                    result.match_ar = _match_rate(tokens, reference)
                result.point = index
                results.append(result)
    bar.close()
    return {
        "machine": machine_info(),
        "settings": asdict(settings),
        "sweep": sweep,
        "results": [asdict(r) for r in results],
        "notes": notes,
    }


def _match_rate(tokens: list[list[int]], reference: list[list[int]] | None) -> float | None:
    if reference is None:
        return None
    return sum(a == b for a, b in zip(tokens, reference, strict=True)) / len(tokens)


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
        logger.warning(text)
