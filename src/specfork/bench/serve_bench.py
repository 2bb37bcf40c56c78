"""Online serving benchmark: Poisson arrivals against a running OpenAI-compatible server.

Each request streams (so time to first token is seen as the client sees it) and asks for usage
at the end. Per request rate: throughput, end-to-end latency, TTFT and TPOT (mean, p50, p99).
Results of several runs (say an AR and an SSD server, each with its own ``label``) written to
the same directory are reported together, as one request-rate table and one plot.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from specfork.bench.timing import clock, summary
from specfork.errors import SpecforkError
from specfork.options import option

SERVE_DATASETS = ("sharegpt", "random")
DEFAULT_RANDOM_INPUT_LEN = 128


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"takes comma-separated numbers or inf, got {text!r}") from None


@dataclass(frozen=True, slots=True)
class ServeBenchSettings:
    base_url: str = option("http://127.0.0.1:8000", "server address", parse=lambda text: text.rstrip("/"))
    label: str = option("server", "name of this run in tables and plots")
    request_rates: tuple[float, ...] = option((1.0,), "comma list of request rates in req/s; inf sends all at once",
                                              parse=parse_rates, flag="--request-rate")
    dataset: str = option("sharegpt", "sharegpt: held-out ShareGPT chats; random: random token ids of --input-len",
                          choices=SERVE_DATASETS)
    num_prompts: int = option(32, "requests per rate")
    input_len: int | None = option(None, f"prompt tokens for --dataset random (default {DEFAULT_RANDOM_INPUT_LEN}); "
                                   "ShareGPT's prompts keep their own lengths")
    output_len: int = option(128, "generated tokens per request (EOS ignored)")
    seed: int = option(0, "arrival-time and random-prompt seed")
    timeout_s: float = option(600.0, "seconds one request may take", flag="--request-timeout")

    def __post_init__(self) -> None:
        if self.dataset not in SERVE_DATASETS:
            raise SpecforkError(f"unknown dataset {self.dataset!r}; choose from {', '.join(SERVE_DATASETS)}")
        if not self.request_rates or any(not (r > 0) for r in self.request_rates):
            raise SpecforkError(f"request rates must be > 0 (inf: all at once), got {self.request_rates}")
        if self.input_len is not None and self.dataset != "random":
            raise SpecforkError(f"--input-len sets the length of --dataset random's prompts; {self.dataset}'s prompts "
                                "keep their own lengths: leave --input-len out, or use --dataset random")
        if self.input_len is None and self.dataset == "random":  # recorded with the results as it ran
            object.__setattr__(self, "input_len", DEFAULT_RANDOM_INPUT_LEN)
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SpecforkError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise SpecforkError(f"request timeout must be > 0 seconds, got {self.timeout_s}")


@dataclass(slots=True)
class RequestResult:
    ok: bool
    start_s: float
    latency_s: float = 0.0
    ttft_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def _requests(settings: ServeBenchSettings, vocab_size: int) -> list[dict]:
    """Request bodies (without ``model``): chat requests from held-out ShareGPT prompts, or
    completions of random token ids."""
    common = {"max_tokens": settings.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if settings.dataset == "random":
        rng = random.Random(settings.seed)
        return [{"prompt": [rng.randrange(vocab_size) for _ in range(settings.input_len)], **common}
                for _ in range(settings.num_prompts)]
    from specfork.datasets import load_prompts

    prompts = load_prompts("sharegpt", "eval", settings.num_prompts)
    if len(prompts) < settings.num_prompts:
        raise SpecforkError(f"the ShareGPT evaluation split has only {len(prompts)} prompts")
    return [{"messages": list(p.messages), "chat": True, **common} for p in prompts]


async def _one(client, model: str, body: dict, t0: float) -> RequestResult:
    body = dict(body)
    chat = body.pop("chat", False)
    # return_token_ids: the first token counts even where it decodes to no text yet (or the model
    # has no tokenizer); servers that do not know the field ignore it.
    extra = {"ignore_eos": body.pop("ignore_eos"), "return_token_ids": True}
    start = clock()
    result = RequestResult(ok=False, start_s=start - t0)
    try:
        if chat:
            stream = await client.chat.completions.create(model=model, extra_body=extra, **body)
        else:
            stream = await client.completions.create(model=model, extra_body=extra, **body)
        async for chunk in stream:
            if result.ttft_s is None and chunk.choices:
                choice = chunk.choices[0]
                piece = choice.delta.content if chat else choice.text
                if piece or (choice.model_extra or {}).get("token_ids"):
                    result.ttft_s = clock() - start
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
        result.latency_s = clock() - start
        result.ok = True
    except Exception as e:  # a refused or broken request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
        result.latency_s = clock() - start
    return result


async def _run_rate(client, model: str, bodies: list[dict], rate: float, seed: int) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    t0 = clock()
    tasks = []
    for i, body in enumerate(bodies):
        tasks.append(asyncio.create_task(_one(client, model, body, t0)))
        if math.isfinite(rate) and i + 1 < len(bodies):  # no wait after the last: it would count as run time
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), clock() - t0


def summarize(results: list[RequestResult], duration_s: float, rate: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_tokens": tokens,
        "output_throughput": tokens / duration_s,
        "e2e_s": summary([r.latency_s for r in ok]),
        "ttft_s": summary([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": summary([r.tpot_s for r in ok if r.tpot_s is not None]),
    }


def run_serve_benchmark(settings: ServeBenchSettings, progress: bool = True) -> dict:
    from openai import AsyncOpenAI, OpenAI

    sync = OpenAI(base_url=f"{settings.base_url}/v1", api_key="specfork", max_retries=0, timeout=10.0)
    try:
        models = sync.models.list().data
    except Exception as e:
        raise SpecforkError(f"no OpenAI-compatible server answers at {settings.base_url} ({type(e).__name__}: {e})") from None
    if not models:
        raise SpecforkError(f"the server at {settings.base_url} lists no models (GET /v1/models)")
    model = models[0].id
    vocab_size = (models[0].model_extra or {}).get("vocab_size", 32000)
    bodies = _requests(settings, vocab_size)

    async def sweep() -> list[dict]:
        client = AsyncOpenAI(base_url=f"{settings.base_url}/v1", api_key="specfork", max_retries=0,
                             timeout=settings.timeout_s)
        rows = []
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(settings.request_rates), desc=f"bench-serve {settings.label}", unit="rate")
        try:
            for i, rate in enumerate(settings.request_rates):
                results, duration = await _run_rate(client, model, bodies, rate, settings.seed + i)
                rows.append(summarize(results, duration, rate))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            await client.close()
        return rows

    rows = asyncio.run(sweep())
    return {"label": settings.label, "model": model, "settings": asdict(settings), "rates": rows}


# ---- reporting -------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(runs: list[dict]) -> str:
    header = ["label", "req/s", "done", "fail", "req/s out", "tok/s", "E2E mean", "E2E p50", "E2E p99",
              "TTFT mean", "TTFT p50", "TTFT p99", "TPOT mean", "TPOT p50", "TPOT p99"]
    rows = []
    for run in runs:
        for r in run["rates"]:
            rows.append([run["label"], f"{r['request_rate']:g}", str(r["completed"]), str(r["failed"]),
                         f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                         *[_ms(r[m][s]) for m in ("e2e_s", "ttft_s", "tpot_s") for s in ("mean", "p50", "p99")]])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines) + "\n(latencies in ms; E2E = end-to-end, TTFT = time to first token, TPOT = time per output token)"


def load_runs(directory: Path) -> list[dict]:
    runs = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "rates" in data and "label" in data:
            runs.append(data)
    return runs


def write_results(run: dict, directory: Path) -> list[Path]:
    """Write ``<label>.json``, then the table and plot of every run in the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run["label"])
    path = directory / f"{safe}.json"
    path.write_text(json.dumps(run, indent=2))
    runs = load_runs(directory)
    text = directory / "serve_results.md"
    text.write_text("```\n" + table(runs) + "\n```\n")
    return [path, text, plot(runs, directory / "serve_latency.png")]


def plot(runs: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for metric, ax, title in zip(("e2e_s", "ttft_s", "tpot_s"), axes, ("end-to-end (p50)", "TTFT (p50)", "TPOT (p50)"),
                                 strict=True):
        for run in runs:
            xs = [r["request_rate"] for r in run["rates"] if r[metric]["p50"] is not None and math.isfinite(r["request_rate"])]
            ys = [r[metric]["p50"] * 1000 for r in run["rates"] if r[metric]["p50"] is not None
                  and math.isfinite(r["request_rate"])]
            ax.plot(xs, ys, marker="o", label=run["label"])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
