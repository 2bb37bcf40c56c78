"""AR vs speculative decoding (n-gram lookup and the shipped draft model) on the embedded
model, with transformers' prompt-lookup and assisted generation (same draft) for comparison.

Greedy, batch 1, fixed output length (EOS ignored), HumanEval and held-out ShareGPT prompts.
Prints tokens/s per engine and mode, mean accepted length, speedups and whether SD reproduced
AR's tokens.

    python benchmarks/bench_sd.py --num-prompts 4 --max-tokens 256 --threads 2
    python benchmarks/bench_sd.py --drafters draft --skip-transformers   # the draft's acceptance only
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from types import SimpleNamespace

import torch

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
from specfork.loading.resolve import resolve_checkpoint
from specfork.outputs import aggregate_metrics


def run_specfork(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    rows = []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([ids], params)[0]
        elapsed = time.perf_counter() - start
        rows.append({"tokens": out.token_ids, "time_s": elapsed, "metrics": out.metrics})
    return rows


def _transformers_model(model: str):
    from transformers import AutoModelForCausalLM

    path = resolve_checkpoint(model).path
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def run_transformers(prompts: list[list[int]], max_tokens: int, lookup: int | None, draft: str | None = None) -> list[dict]:
    model = _transformers_model("smollm2-135m")
    kwargs = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=2)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    if draft:
        kwargs["assistant_model"] = _transformers_model(draft)
    rows = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        for ids in prompts:
            start = time.perf_counter()
            out = model.generate(torch.tensor([ids]), **kwargs)
            elapsed = time.perf_counter() - start
            rows.append({"tokens": out[0, len(ids):].tolist(), "time_s": elapsed})
    return rows


def summarize(rows: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) for r in rows)
    seconds = sum(r["time_s"] for r in rows)
    out = {"tok_per_s": tokens / seconds, "tokens": tokens, "time_s": seconds}
    if all(r.get("metrics", {}).get("spec_rounds") for r in rows):
        agg = aggregate_metrics([SimpleNamespace(metrics=r["metrics"]) for r in rows])
        out["mean_accepted_length"] = agg["mean_accepted_length"]
        out["acceptance_rate"] = agg["acceptance_rate"]
        out["ssd_cache_hit_rate"] = agg.get("ssd_cache_hit_rate")
        out["ssd_hidden_fraction"] = agg.get("ssd_hidden_fraction")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per dataset (default 4)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=5, help="n-gram proposals per round (default 5)")
    parser.add_argument("--lookup", type=int, default=10, help="transformers prompt_lookup_num_tokens (default 10)")
    parser.add_argument("--datasets", default="humaneval,sharegpt")
    parser.add_argument("--drafters", default="ngram,draft,ssd",
                        help="speculative runs: ngram (SD), draft (SD with --draft), ssd (SSD with --draft: "
                        "target and drafter get half of the cores each) (default: all three)")
    parser.add_argument("--fan-out", type=int, default=3, help="SSD fan-out per outcome (default 3)")
    parser.add_argument("--backup", default="jit", choices=["jit", "fast"], help="SSD cache-miss backup")
    parser.add_argument("--draft", default="default", help="draft model for --drafters draft (default: the shipped one)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ar = LLM(threads=args.threads)
    drafters = args.drafters.split(",")
    sd = {}
    if "ngram" in drafters:
        sd[f"specfork SD ngram k={args.k}"] = LLM(threads=args.threads, mode="sd", drafter="ngram", k=args.k)
    if "draft" in drafters:
        sd[f"specfork SD draft k={args.k}"] = LLM(threads=args.threads, mode="sd", draft=args.draft, k=args.k)
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                           "torch": torch.__version__},
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
               "args": vars(args), "datasets": {}}
    for dataset in args.datasets.split(","):
        prompts = [encode(ar, p) for p in load_prompts(dataset, "eval", args.num_prompts)]
        runs = {"specfork AR": run_specfork(ar, prompts, args.max_tokens)}
        for name, llm in sd.items():
            runs[name] = run_specfork(llm, prompts, args.max_tokens)
        if "ssd" in drafters:
            # Built per dataset and closed after: SSD pins this process to the target's cores
            # while it lives, and AR/SD must keep all of them.
            name = f"specfork SSD k={args.k} F={args.fan_out} {args.backup}"
            with LLM(mode="ssd", draft=args.draft, k=args.k, fan_out=args.fan_out, backup=args.backup) as ssd:
                runs[name] = run_specfork(ssd, prompts, args.max_tokens)
        if not args.skip_transformers:
            runs["transformers AR"] = run_transformers(prompts, args.max_tokens, None)
            if "ngram" in drafters:
                runs[f"transformers prompt-lookup {args.lookup}"] = run_transformers(prompts, args.max_tokens, args.lookup)
            if "draft" in drafters:
                from specfork.loading.resolve import resolve_draft

                path = resolve_draft(args.draft, resolve_checkpoint("smollm2-135m"))
                runs["transformers assisted (same draft)"] = run_transformers(prompts, args.max_tokens, None, path)
        ar_tokens = [r["tokens"] for r in runs["specfork AR"]]
        summary = {}
        for name, rows in runs.items():
            s = summarize(rows)
            s["match_ar"] = sum(r["tokens"] == t for r, t in zip(rows, ar_tokens, strict=True)) / len(rows)
            summary[name] = s
        results["datasets"][dataset] = summary
        base = summary["specfork AR"]["tok_per_s"]
        print(f"\n{dataset}: {len(prompts)} prompts x {args.max_tokens} tokens, greedy, batch 1, "
              f"{args.threads} threads")
        print(f"{'engine / mode':36s} {'tok/s':>8s} {'vs specfork AR':>15s} {'accept len':>11s} {'hit rate':>9s} "
              f"{'= AR':>6s}")
        for name, s in summary.items():
            acc = f"{s['mean_accepted_length']:.2f}" if "mean_accepted_length" in s else "-"
            hit = f"{s['ssd_cache_hit_rate']:.2f}" if s.get("ssd_cache_hit_rate") is not None else "-"
            print(f"{name:36s} {s['tok_per_s']:8.2f} {s['tok_per_s'] / base:14.2f}x {acc:>11s} {hit:>9s} "
                  f"{s['match_ar']:6.0%}")
    if len(results["datasets"]) > 1:
        names = list(next(iter(results["datasets"].values())))
        print("\nmean over datasets:")
        for name in names:
            print(f"{name:36s} {statistics.mean(d[name]['tok_per_s'] for d in results['datasets'].values()):8.2f} tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
