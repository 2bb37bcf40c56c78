"""Autoregressive decoding of the embedded model: specfork vs transformers, the memory bandwidth
it reaches, and throughput with concurrent requests.

Greedy, fixed output length (EOS ignored), HumanEval and held-out ShareGPT prompts (chat
template applied), the same prompt ids for both engines. For each thread count:

* batch 1, one prompt at a time, specfork and transformers ``generate`` (fp32, same GGUF):
  tokens/s = generated tokens / wall time (prefill included), and decode tokens/s from the time
  per output token (TPOT, prefill excluded);
* the weight bandwidth specfork reaches: weight bytes read per decoded token (every linear
  layer once, the tied LM head once, norms; the embedding lookup is negligible) x decode tok/s,
  next to the machine's read bandwidth measured with the same thread count (best-of-N sum over
  a 1 GiB fp32 tensor);
* throughput with 8 and 32 concurrent requests (distinct prompts, one ``generate`` call) and
  its ratio to batch 1.

One short generate warms each engine up before timing. The default run takes about 10 minutes
on 2 cores.

    python benchmarks/bench_ar.py                      # 3 prompts per dataset, 256 tokens, 1 and 2 threads
    python benchmarks/bench_ar.py --num-prompts 1 --max-tokens 64 --threads 2 --skip-transformers
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
import warnings

import torch

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
from specfork.layers.cpu_kernels import kernels as native_kernels
from specfork.layers.linear import DenseLinear
from specfork.layers.norm import RMSNorm
from specfork.loading.resolve import resolve_checkpoint

DATASETS = ("humaneval", "sharegpt")
MODEL = "smollm2-135m"


# ---- machine and model ----------------------------------------------------------------------


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """Best-of-N GB/s with the current torch thread count: a read-only sum and a copy
    (counted as bytes read + bytes written). On this VM it varies by up to 2x between minutes
    with 2 threads, so the benchmark measures before and after each thread count."""
    n = int(gib * 2**30) // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    dst.copy_(src)  # fault in the pages
    read = copy = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        read = min(read, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
    return {"read_GBps": n * 4 / read / 1e9, "copy_GBps": 2 * n * 4 / copy / 1e9}


def bytes_read_per_token(llm: LLM) -> dict:
    """Weight bytes one decode step reads for one sequence, and KV-cache bytes per context token.

    A DenseLinear keeps more than one layout of its weight but reads one per call, so each is
    counted once at its logical size; the LM head (tied to the embedding here) is a DenseLinear
    and counts once; the embedding lookup reads a single row and is left out."""
    model = llm.engine.runner.model
    linear = norms = 0
    for m in model.modules():
        if isinstance(m, DenseLinear):
            linear += m.weight.numel() * m.weight.element_size()
            if m.bias is not None:
                linear += m.bias.numel() * m.bias.element_size()
        elif isinstance(m, RMSNorm):
            norms += sum(p.numel() * p.element_size() for p in m.parameters())
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.embed_tokens.weight.element_size()
    return {"weights": linear + norms, "linear": linear, "norms": norms, "kv_per_context_token": kv}


class ForeignLoad:
    """CPU cores used by other processes while timing (from /proc/stat minus this process's CPU
    time). On a 2-core machine any other busy process distorts the numbers, 2 threads most."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle, iowait
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.perf_counter()

    def cores(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, own, wall = (b - a for a, b in zip(self.start, end, strict=True))
        return max(0.0, (busy - own) / wall) if wall > 0 else None


# ---- runs ----------------------------------------------------------------------------------


def _summary(rows: list[dict], wall_s: float | None = None) -> dict:
    """Totals of per-request rows {generated, time_s, ttft_s, tpot_s}. tok/s = tokens / time
    (summed per-request wall times, or ``wall_s`` for one concurrent batch); decode tok/s from
    TPOT: for batch 1 the pooled (n-1) / sum((n-1) * tpot); for a concurrent batch the sum of the
    requests' decode rates 1/tpot."""
    tokens = sum(r["generated"] for r in rows)
    seconds = wall_s if wall_s is not None else sum(r["time_s"] for r in rows)
    timed = [r for r in rows if r["tpot_s"]]
    if wall_s is None:
        decode = sum(r["generated"] - 1 for r in timed) / sum((r["generated"] - 1) * r["tpot_s"] for r in timed)
    else:
        decode = sum(1 / r["tpot_s"] for r in timed)
    return {
        "requests": len(rows),
        "generated_tokens": tokens,
        "time_s": seconds,
        "tok_s": tokens / seconds,
        "decode_tok_s": decode,
        "mean_ttft_s": sum(r["ttft_s"] for r in rows) / len(rows),
        "mean_prompt_tokens": sum(r["prompt_tokens"] for r in rows) / len(rows),
    }


def _row(out, elapsed: float) -> dict:
    m = out.metrics
    return {
        "prompt_tokens": m["num_prompt_tokens"],
        "generated": m["num_generated_tokens"],
        "time_s": elapsed,
        "ttft_s": m["ttft_s"],
        "tpot_s": m["tpot_s"],
        "preemptions": m["num_preemptions"],
    }


def specfork_batch1(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    rows = []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([ids], params)[0]
        rows.append(_row(out, time.perf_counter() - start) | {"token_ids": out.token_ids})
    return rows


def specfork_concurrent(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[dict], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    return [_row(o, o.metrics["time_s"]) for o in outs], wall


class _TokenClock:
    """A ``generate`` streamer that only timestamps: the first put is the prompt, then one put
    per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_transformers():
    from transformers import AutoModelForCausalLM

    path = resolve_checkpoint(MODEL).path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def transformers_batch1(model, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    kwargs = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad)
    model.generate(torch.tensor([prompts[0]]), **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    rows = []
    for ids in prompts:
        clock = _TokenClock()
        start = time.perf_counter()
        out = model.generate(torch.tensor([ids]), streamer=clock, **kwargs)
        elapsed = time.perf_counter() - start
        new = out[0, len(ids) :].tolist()
        first, last = clock.times[1], clock.times[-1]
        rows.append({
            "prompt_tokens": len(ids),
            "generated": len(new),
            "time_s": elapsed,
            "ttft_s": first - start,
            "tpot_s": (last - first) / (len(new) - 1) if len(new) > 1 else None,
            "token_ids": new,
        })
    return rows


# ---- main ------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=3, help="batch-1 prompts per dataset (default 3)")
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per request (default 256)")
    parser.add_argument("--threads", type=_int_list, default=[1, 2], help="thread counts, e.g. 1,2 (default)")
    parser.add_argument("--concurrency", type=_int_list, default=[8, 32],
                        help="concurrent requests for the throughput runs (default 8,32)")
    parser.add_argument("--skip-transformers", action="store_true", help="do not run transformers generate")
    parser.add_argument("--bandwidth-gib", type=float, default=1.0, help="tensor size for the bandwidth test")
    parser.add_argument("--json", metavar="OUT", help="write all results (per request too) to this file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    max_conc = max(args.concurrency)
    llm = LLM(model=MODEL, max_num_seqs=max(32, max_conc), kv_cache_tokens=max(16384, max_conc * 1024))
    per_dataset = max(args.num_prompts, -(-max_conc // len(DATASETS)))
    pool = {d: [encode(llm, p) for p in load_prompts(d, "eval", per_dataset)] for d in DATASETS}
    batch1 = [(d, ids) for d in DATASETS for ids in pool[d][: args.num_prompts]]
    mixed = [ids for pair in zip(*pool.values(), strict=True) for ids in pair]  # alternate datasets
    nbytes = bytes_read_per_token(llm)
    hf = None if args.skip_transformers else load_transformers()

    results = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "native_kernel": native_kernels() is not None},
        "args": vars(args), "bytes_per_token": nbytes, "runs": [],
    }
    print(f"{MODEL}: {nbytes['weights'] / 1e6:.1f} MB of weights read per decoded token "
          f"(+{nbytes['kv_per_context_token'] / 1e3:.1f} kB KV per context token); "
          f"batch 1: {args.num_prompts} prompts per dataset ({', '.join(DATASETS)}), "
          f"{args.max_tokens} new tokens, greedy, EOS ignored", flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        load = ForeignLoad()
        bw = {"before": measure_bandwidth(args.bandwidth_gib), "before_foreign_cores": load.cores()}
        print(f"\n[threads={threads}] read bandwidth {bw['before']['read_GBps']:.1f} GB/s, "
              f"copy {bw['before']['copy_GBps']:.1f} GB/s", flush=True)
        run = {"threads": threads, "bandwidth": bw, "batch1": {}, "concurrent": {}}
        engines = {"specfork": lambda ps: specfork_batch1(llm, ps, args.max_tokens)}
        if hf is not None:
            engines["transformers"] = lambda ps: transformers_batch1(hf, ps, args.max_tokens)
        for engine, fn in engines.items():
            load = ForeignLoad()
            rows = fn([ids for _, ids in batch1])
            for (dataset, _), r in zip(batch1, rows, strict=True):
                r["dataset"] = dataset
            summary = {d: _summary([r for r in rows if r["dataset"] == d]) for d in DATASETS}
            summary["all"] = _summary(rows)
            run["batch1"][engine] = {"summary": summary, "requests": rows, "foreign_cores": load.cores()}
            _progress(f"{engine} batch 1", summary["all"], run["batch1"][engine]["foreign_cores"])
        if hf is not None:
            # min_new_tokens masks EOS in transformers while ignore_eos lets specfork emit it and go
            # on, so the outputs are compared up to specfork's first EOS.
            same = []
            for a, b in zip(run["batch1"]["specfork"]["requests"], run["batch1"]["transformers"]["requests"],
                            strict=True):
                ours = _before_eos(a["token_ids"], llm)
                same.append(b["token_ids"][: len(ours)] == ours)
            run["same_tokens_as_transformers"] = f"{sum(same)}/{len(same)}"
        for n in args.concurrency:
            load = ForeignLoad()
            rows, wall = specfork_concurrent(llm, mixed[:n], args.max_tokens)
            run["concurrent"][n] = {"summary": _summary(rows, wall), "requests": rows, "foreign_cores": load.cores(),
                                    "preemptions": sum(r["preemptions"] for r in rows)}
            _progress(f"specfork {n} concurrent", run["concurrent"][n]["summary"], run["concurrent"][n]["foreign_cores"])
        load = ForeignLoad()
        bw["after"] = measure_bandwidth(args.bandwidth_gib)
        bw["after_foreign_cores"] = load.cores()
        for key in ("read_GBps", "copy_GBps"):  # the machine's bandwidth varies from one minute to the next
            bw[key] = max(bw["before"][key], bw["after"][key])
        print(f"  read bandwidth afterwards {bw['after']['read_GBps']:.1f} GB/s", flush=True)
        results["runs"].append(run)

    print_table(results)
    if args.json:
        for run in results["runs"]:
            for engine in run["batch1"].values():
                for r in engine["requests"]:
                    r.pop("token_ids", None)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _before_eos(token_ids: list[int], llm: LLM) -> list[int]:
    eos = llm.engine.eos_token_ids
    return next((token_ids[:i] for i, t in enumerate(token_ids) if t in eos), token_ids)


def _progress(label: str, s: dict, foreign: float | None) -> None:
    other = f", other processes used {foreign:.2f} cores" if foreign is not None and foreign > 0.1 else ""
    print(f"  {label:24s} {s['tok_s']:6.1f} tok/s, decode {s['decode_tok_s']:6.1f} tok/s{other}", flush=True)


def _fmt_load(foreign: float | None) -> str:
    return "" if foreign is None else f"{foreign:.2f}"


def print_table(results: dict) -> None:
    wbytes = results["bytes_per_token"]["weights"]
    header = (f"{'thr':>3} {'engine':12} {'requests':16} {'tok/s':>7} {'decode':>7} {'TTFT ms':>8} "
              f"{'prompt':>6} {'wGB/s':>6} {'%bw':>5} {'sf/hf':>6} {'vs b1':>6} {'other':>5}")
    print("\n" + header)
    print("-" * len(header))
    noisy = False
    for run in results["runs"]:
        read_bw = run["bandwidth"]["read_GBps"]
        b1 = run["batch1"]
        for key in ("before_foreign_cores", "after_foreign_cores"):
            noisy |= (run["bandwidth"][key] or 0.0) > 0.1
        for engine, data in b1.items():
            load = data["foreign_cores"]
            noisy |= load is not None and load > 0.1
            for name, s in data["summary"].items():
                gbps = wbytes * s["decode_tok_s"] / 1e9
                ratio = ""
                if engine == "specfork" and "transformers" in b1:
                    ratio = f"{s['tok_s'] / b1['transformers']['summary'][name]['tok_s']:5.2f}x"
                print(f"{run['threads']:>3} {engine:12} {'b1 ' + name:16} {s['tok_s']:7.1f} {s['decode_tok_s']:7.1f} "
                      f"{s['mean_ttft_s'] * 1e3:8.0f} {s['mean_prompt_tokens']:6.0f} {gbps:6.1f} "
                      f"{gbps / read_bw:5.0%} {ratio:>6} {'':>6} {_fmt_load(load):>5}")
        base = b1["specfork"]["summary"]["all"]["tok_s"]
        for n, data in run["concurrent"].items():
            s, load = data["summary"], data["foreign_cores"]
            noisy |= load is not None and load > 0.1
            print(f"{run['threads']:>3} {'specfork':12} {f'{n} concurrent':16} {s['tok_s']:7.1f} "
                  f"{s['decode_tok_s']:7.1f} {s['mean_ttft_s'] * 1e3:8.0f} {s['mean_prompt_tokens']:6.0f} "
                  f"{'':>6} {'':>5} {'':>6} {s['tok_s'] / base:5.1f}x {_fmt_load(load):>5}")
        note = f"; same tokens as transformers (up to EOS): {run['same_tokens_as_transformers']}" \
            if "same_tokens_as_transformers" in run else ""
        bw = run["bandwidth"]
        print(f"    (threads={run['threads']}: read bandwidth {bw['before']['read_GBps']:.1f} GB/s before, "
              f"{bw['after']['read_GBps']:.1f} after (%bw uses the higher); copy {bw['copy_GBps']:.1f} GB/s{note})")
    print("tok/s: generated tokens / wall time (prefill included); decode: tok/s from TPOT (batch 1: pooled;\n"
          "concurrent: sum of per-request 1/TPOT); wGB/s: weight bytes per token x decode tok/s; %bw: of the\n"
          "measured read bandwidth; sf/hf: specfork / transformers tok/s; vs b1: concurrent / batch-1 tok/s;\n"
          "other: CPU cores used by other processes meanwhile.")
    if noisy:
        print("WARNING: other processes used CPU during timing; these numbers are not reliable.")


if __name__ == "__main__":
    main()
