"""The ``specfork`` command line. The only module that prints, reads the environment or
configures logging."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import NoReturn

from specfork.config import DEFAULT_MODEL
from specfork.errors import PromptError, SpecforkError
from specfork.serve.server import DEFAULT_MAX_REQUEST_BYTES

EXIT_BAD_INPUT = 2
DEMO_PROMPT = "Write a Python function that checks whether a number is prime."


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where to read more, not the usage block."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model alias, HF model directory or .gguf file (default: {DEFAULT_MODEL}, the embedded "
        "SmolLM2-135M-Instruct Q4_1 GGUF)",
    )
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weight/activation dtype (default: float32; bf16/fp16 on CUDA only)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--max-num-seqs", type=int, default=32, help="most sequences decoded together (default: 32)")
    g.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="most tokens in one forward pass; longer prompts are prefilled in chunks (default: 4096)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    g.add_argument("--kv-cache-tokens", type=int, default=16384,
                   help="KV-cache capacity in tokens over all sequences (default: 16384)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's context length, capped by the KV cache)")
    g.add_argument("--weights", default="native", choices=["native", "fp32"],
                   help="native: run a GGUF's Q4_0/Q4_1/Q8_0 matrices quantised (native CPU kernel, no per-step "
                   "dequantisation); fp32: dequantise at load (default: native)")
    g.add_argument("--quantize", default=None, choices=["int4"],
                   help="quantise an HF checkpoint's projections to 4 bits at load (default: off)")
    g.add_argument("--quantize-group", type=int, default=32, choices=[32, 64, 128],
                   help="inputs per scale for --quantize (default: 32)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--mode", default="ar", choices=["ar", "sd", "ssd"],
                   help="ar: autoregressive; sd: speculative decoding (a drafter proposes --k tokens, the "
                   "model verifies them in one pass; output distribution unchanged); ssd: speculative "
                   "speculative decoding (the draft runs in its own process on its own cores/GPU and "
                   "pre-drafts the next round for likely verification outcomes) (default: ar)")
    s.add_argument("--drafter", default="draft", choices=["draft", "ngram"],
                   help="SD proposer: a draft model (--draft) or n-gram prompt lookup (default: draft)")
    s.add_argument("--draft", default=None, help="draft model for --drafter draft: HF directory or .gguf file "
                   "sharing the target's vocabulary, or 'default' (also used when omitted): the draft shipped "
                   "with specfork for the embedded model")
    s.add_argument("--k", type=_k_value, default=5,
                   help="tokens proposed per round, or auto (SD): chosen from the draft and target step times "
                   "measured at start-up and the acceptance observed while generating; the choice and its "
                   "reasons are reported (default: 5)")
    s.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched by --drafter ngram (default: 1)")
    s.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched by --drafter ngram (default: 4)")
    x = p.add_argument_group("SSD (--mode ssd)")
    x.add_argument("--fan-out", type=int, default=3,
                   help="branches pre-drafted per verification outcome, uniform (default: 3)")
    x.add_argument("--fan-out-list", default=None,
                   help="per-outcome fan-out, k+1 counts like 3,2,2,1,1,1, or geometric:TOTAL for the paper's "
                   "capped-geometric allocation (overrides --fan-out)")
    x.add_argument("--fan-out-list-miss", default=None,
                   help="fan-out after a round that missed the cache, same forms and total (default: the hit list)")
    x.add_argument("--backup", default="jit", choices=["jit", "fast"],
                   help="on a cache miss: jit drafts now; fast guesses by n-gram lookup with no draft compute "
                   "(default: jit)")
    x.add_argument("--saguaro-x", type=float, default=None,
                   help="Saguaro sampling coefficient C in (0, 1] for temperature > 0 (default: off)")
    x.add_argument("--tree-backend", default="fast", choices=["fast", "sdpa"],
                   help="tree-decode attention: fast (per-branch block tables, native paged kernel) or sdpa "
                   "(reference, explicit tree mask) (default: fast)")
    x.add_argument("--target-cores", default=None, help="CPU cores of the target, e.g. 0 or 0-3 "
                   "(default: the first half of the available cores)")
    x.add_argument("--draft-cores", default=None, help="CPU cores of the drafter process (default: the other half)")
    x.add_argument("--drafter-device", default=None,
                   help="the drafter's device (default: the next GPU on CUDA, else the CPU)")
    x.add_argument("--drafter-timeout", type=_timeout_value, default=None,
                   help="seconds to wait for the drafter before declaring it failed (requests continue "
                   "in-process while it restarts), or auto: 10x the observed round time, 2 to 60 s "
                   "(default: auto)")
    s.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: greedy SD output is bit-identical to AR output (slower)")
    g.add_argument("--seed", type=int, default=None,
                   help="the engine's seed, the same in generate and serve: each request samples with a generator "
                   "derived from it and the request's position, so a run is reproducible (default: 0)")


def _timeout_value(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds or auto, got {text!r}") from None


def _k_value(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {text!r}") from None


def _engine_options(args: argparse.Namespace) -> dict:
    seed = {} if args.seed is None else {"seed": args.seed}
    return seed | {
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_model_len": args.max_model_len,
        "mode": args.mode,
        "drafter": args.drafter,
        "draft": args.draft,
        "k": args.k,
        "ngram_min": args.ngram_min,
        "ngram_max": args.ngram_max,
        "deterministic": args.deterministic,
        "fan_out": args.fan_out,
        "fan_out_list": args.fan_out_list,
        "fan_out_list_miss": args.fan_out_list_miss,
        "backup": args.backup,
        "saguaro_x": args.saguaro_x,
        "tree_backend": args.tree_backend,
        "target_cores": args.target_cores,
        "draft_cores": args.draft_cores,
        "drafter_device": args.drafter_device,
        "drafter_timeout_s": args.drafter_timeout,
        "weights": args.weights,
        "quantize": args.quantize,
        "quantize_group": args.quantize_group,
    }


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS (fixed-length outputs)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specfork",
        description="specfork: exact speculative decoding (AR and SD; SSD builds on them). "
        "Run `specfork generate` to generate with the embedded SmolLM2-135M model.",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt or a JSONL file of prompts",
        description="Generate text. With --prompt the reply streams to the terminal; with "
        "--prompts-file every line is one request and all run batched together.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="prompts file lines (JSON objects; other keys are ignored):\n"
        '  {"prompt": "raw text"}            tokenized as the tokenizer says, no chat template\n'
        '  {"messages": [{"role": "user", "content": "..."}]}   chat template applied\n'
        '  {"token_ids": [1, 2, 3]}          used as given\n'
        "output lines (--output): {\"token_ids\": [...], \"text\": \"...\", \"metrics\": {...}} in input order",
    )
    src = gen.add_argument_group("prompts").add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt; chat-templated when the model has a template (see --raw); "
                     f"without --prompt and --prompts-file the demo prompt {DEMO_PROMPT!r} is used (and said)")
    src.add_argument("--prompts-file", type=Path, help="JSONL file of prompts (see below)")
    gen.add_argument("--raw", action="store_true", help="with --prompt: use the text as is, without the chat template")
    gen.add_argument("--output", type=Path, help="write one JSON line per prompt to this file")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                     help="progress bar for --prompts-file (default: on)")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    sub.add_parser(
        "models",
        help="list the model aliases and shipped drafts, with their file paths",
        description="Print each model alias (usable as --model NAME) with the file it stands for, and the "
        "drafts shipped with specfork (used by --mode sd|ssd when --draft is not given).",
    )
    sub.add_parser(
        "build-kernels",
        help="compile the native CPU kernels now, with progress (install.sh runs it)",
        description="Compile specfork's native CPU kernels (quantised GEMM, paged attention, fused decoder "
        "layer) for this machine: about 2 minutes on 2 cores, once. The build is cached under "
        "~/.cache/specfork/kernels, keyed by the sources, the torch version and the compiler flags, so "
        "a second install or any later run imports it at once. Without a C++ compiler specfork still "
        "runs, on slower PyTorch paths.",
    )
    _add_train_draft_parser(sub)
    _add_export_gguf_parser(sub)
    _add_bench_parser(sub)
    _add_serve_parser(sub)
    _add_bench_serve_parser(sub)
    return parser


def _add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve the model over an OpenAI-compatible API: GET /v1/models, POST /v1/completions, "
        "POST /v1/chat/completions (stream: true for server-sent events), GET /health, GET /metrics "
        "(Prometheus). All requests share one engine with continuous batching; every mode and "
        "speculative option of `generate` applies. SIGINT/SIGTERM stop it gracefully.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond the --max-num-seqs running ones; more are refused "
                   "with 503 (default: 256)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds open requests may take to finish after SIGINT/SIGTERM; then they end with "
                   "finish_reason abort (default: 30)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are refused with 413 (default: %(default)s)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (401 otherwise); the "
                   "environment variable SPECFORK_API_KEY sets it without showing it in the process list")
    _add_engine_args(p)


def _add_bench_serve_parser(sub) -> None:
    p = sub.add_parser(
        "bench-serve",
        help="drive a running server with Poisson arrivals; latency and throughput per request rate",
        description="Send --num-prompts streaming requests at each --request-rate (Poisson arrivals) to a "
        "running `specfork serve` (or any OpenAI-compatible server) and report throughput, end-to-end "
        "latency, TTFT and TPOT (mean, p50, p99). Results go to --out/<label>.json; the table and plot "
        "there cover every run in that directory, so AR and SSD servers benchmarked with different "
        "--label values are compared side by side.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default: %(default)s)")
    p.add_argument("--label", default="server", help="name of this run in tables and plots (default: server)")
    p.add_argument("--request-rate", default="1", help="comma list of request rates in req/s; inf sends all at "
                   "once (default: 1)")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random"],
                   help="sharegpt: held-out ShareGPT chats; random: random token ids of --input-len (default: sharegpt)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per rate (default: 32)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens for --dataset random (default: 128)")
    p.add_argument("--output-len", type=int, default=128,
                   help="generated tokens per request (EOS ignored) (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="arrival-time and random-prompt seed (default: 0)")
    p.add_argument("--out", type=Path, default=Path("bench-serve-results"),
                   help="output directory (default: bench-serve-results)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar (default: on)")


def _add_bench_parser(sub) -> None:
    from specfork.bench.settings import DATASETS, MODES, PEERS, SWEEPABLE, BenchSettings

    p = sub.add_parser(
        "bench",
        help="benchmark AR / SD / SSD / n-gram side by side (and peers): table, JSON, Markdown, PNG",
        description="Run every mode on every dataset (median over --repeat runs after --warmup), "
        "check greedy speculative outputs against AR token for token, and write results.json, "
        "results.md and PNG plots to --out. Peers (transformers, llama.cpp) run on the same "
        "prompts and are skipped with a message when not installed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="sweeps: --sweep 'k=2,3,5;fan_out=1,3' runs the full grid; sweepable: " + ", ".join(SWEEPABLE),
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    p.add_argument("--draft", default="default", help="draft for sd/ssd (default: the shipped draft)")
    p.add_argument("--modes", default="ar,sd,ssd,ngram", help=f"comma list of {', '.join(MODES)} (default: all)")
    p.add_argument("--datasets", default="humaneval,sharegpt",
                   help=f"comma list of {', '.join(DATASETS)}, or all (default: humaneval,sharegpt); with "
                   "several, an 'all' row gives the mean")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per dataset (default: 4)")
    p.add_argument("--input-len", type=int, default=None,
                   help="cut (keeping the end) or repeat prompts to this many tokens; required for random")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument("--k", type=_k_value, default=5,
                   help="speculated tokens per round, or auto (sd and ngram modes: chosen from measured costs; default: 5)")
    p.add_argument("--fan-out", type=int, default=3, help="SSD fan-out per outcome (default: 3)")
    p.add_argument("--backup", default="jit", choices=["jit", "fast"], help="SSD cache-miss backup (default: jit)")
    p.add_argument("--batch-size", type=int, default=1, help="concurrent requests (default: 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for AR/SD and peers (default: torch's)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs; the median is reported (default: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs (default: 1)")
    p.add_argument("--target-cores", default=None, help="SSD: the target's CPU cores (default: half of them)")
    p.add_argument("--draft-cores", default=None, help="SSD: the drafter's CPU cores (default: the other half)")
    p.add_argument("--peers", default="", help=f"comma list of {', '.join(PEERS)} (default: none)")
    p.add_argument("--sweep", default=None, help="grid of overrides, e.g. 'k=2,3,5;fan_out=1,3'")
    p.add_argument("--bandwidth", action="store_true",
                   help=BenchSettings.__dataclass_fields__["bandwidth"].metadata["help"])
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default: bench-results)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar (default: on)")


def _add_train_draft_parser(sub) -> None:
    from specfork.training.settings import DataSettings, DraftArch, TrainSettings

    d, a, t = DataSettings(), DraftArch(), TrainSettings()
    p = sub.add_parser(
        "train-draft",
        help="train a small draft model for a target (distilled from the target's own outputs)",
        description="Train a Llama-architecture draft sharing the target's vocabulary: the target "
        "answers training prompts from ShareGPT's train split (chat turns and code-block "
        "prefixes), the draft learns to predict its tokens, and a final SD run on held-out "
        "prompts reports the mean accepted length. Everything is kept under --work-dir, so "
        "running the same command again resumes an interrupted run.",
    )
    p.add_argument("--target", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    p.add_argument("--output", type=Path, required=True, help="directory for the trained draft (HF format)")
    p.add_argument("--work-dir", type=Path, help="data shards and checkpoints (default: OUTPUT.work)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's choice)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bars (default: on)")
    g = p.add_argument_group("data (target responses)")
    g.add_argument("--num-prompts", type=int, default=d.num_prompts, help=f"training prompts (default {d.num_prompts})")
    g.add_argument("--code-fraction", type=float, default=d.code_fraction,
                   help=f"share of code-block prompts (default {d.code_fraction})")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"response length cap (default {d.max_new_tokens})")
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help=f"prompts keep their last N tokens (default {d.max_prompt_tokens})")
    g.add_argument("--generation-batch", type=int, default=32, help="concurrent generation requests (default 32)")
    g = p.add_argument_group("draft architecture")
    g.add_argument("--hidden-size", type=int, default=a.hidden_size, help=f"(default {a.hidden_size})")
    g.add_argument("--layers", type=int, default=a.num_layers, help=f"(default {a.num_layers})")
    g.add_argument("--intermediate-size", type=int, default=a.intermediate_size, help=f"(default {a.intermediate_size})")
    g.add_argument("--heads", type=int, default=a.num_heads, help=f"(default {a.num_heads})")
    g.add_argument("--kv-heads", type=int, default=a.num_kv_heads, help=f"(default {a.num_kv_heads})")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=t.epochs, help=f"passes over the data (default {t.epochs})")
    g.add_argument("--batch-tokens", type=int, default=t.batch_tokens,
                   help=f"padded tokens per optimizer step (default {t.batch_tokens})")
    g.add_argument("--max-seq-len", type=int, default=t.max_seq_len, help=f"(default {t.max_seq_len})")
    g.add_argument("--lr", type=float, default=t.lr, help=f"peak learning rate, cosine decay (default {t.lr})")
    g.add_argument("--warmup-steps", type=int, default=t.warmup_steps, help=f"(default {t.warmup_steps})")
    g.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every, help=f"steps (default {t.checkpoint_every})")
    g.add_argument("--seed", type=int, default=t.seed, help=f"data order, prompt selection and init (default {t.seed})")
    g = p.add_argument_group("final evaluation")
    g.add_argument("--eval-prompts", type=int, default=4,
                   help="held-out HumanEval and ShareGPT prompts for the SD acceptance check; 0 skips it (default 4)")
    g.add_argument("--eval-tokens", type=int, default=128, help="tokens per evaluation prompt (default 128)")


def _add_export_gguf_parser(sub) -> None:
    from specfork.loading.gguf_export import OUT_TYPES

    p = sub.add_parser(
        "export-gguf",
        help="write an HF Llama checkpoint (e.g. a trained draft) as a GGUF file for llama.cpp",
        description="Write a Llama-architecture HF checkpoint directory as GGUF. The tokenizer "
        "metadata is copied from --vocab-from (for a draft made by train-draft: its target, "
        "by default), so llama.cpp accepts the file as that target's draft model.",
    )
    p.add_argument("checkpoint", help="HF checkpoint directory")
    p.add_argument("output", type=Path, help="the .gguf file to write")
    p.add_argument("--vocab-from", help="GGUF file or alias whose tokenizer is copied "
                   "(default: the target recorded by train-draft, when it is a GGUF)")
    p.add_argument("--outtype", choices=OUT_TYPES, default="q8_0",
                   help="type of the 2-D weights; norms stay f32 (default q8_0)")


def read_prompts_file(path: Path) -> list[dict]:
    """Parse a prompts JSONL file into {"prompt"|"messages"|"token_ids": ...} dicts."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise SpecforkError(f"cannot read prompts file {path}: {e.strerror}") from None
    prompts = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecforkError(f"{path}:{lineno}: line is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecforkError(f"{path}:{lineno}:{e.colno}: not valid JSON: {e.msg} (line {lineno}, column "
                                f"{e.colno})") from None
        if not isinstance(obj, dict):
            raise SpecforkError(f"{path}:{lineno}: each line must be a JSON object")
        keys = [k for k in ("prompt", "messages", "token_ids") if k in obj]
        if len(keys) != 1:
            raise SpecforkError(f"{path}:{lineno}: each line needs exactly one of 'prompt', 'messages' or 'token_ids'")
        prompts.append({keys[0]: obj[keys[0]], "_line": lineno})
    if not prompts:
        raise SpecforkError(f"prompts file {path} contains no prompts")
    return prompts


def _encode_file_prompts(llm, prompts: list[dict], path: Path) -> list[list[int]]:
    ids = []
    for p in prompts:
        try:
            if "prompt" in p:
                if not isinstance(p["prompt"], str):
                    raise SpecforkError("'prompt' must be a string")
                ids.append(llm.encode(p["prompt"]))
            elif "messages" in p:
                ids.append(llm.encode_chat(p["messages"]))
            else:
                if not isinstance(p["token_ids"], list):
                    raise SpecforkError("'token_ids' must be a list of integers")
                ids.append(llm.encode(p["token_ids"]))
        except SpecforkError as e:
            raise type(e)(f"{path}:{p['_line']}: {e}") from None
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    from specfork import LLM, SamplingParams
    from specfork.outputs import aggregate_metrics

    if args.prompt == "":
        raise PromptError("prompt is empty")
    if args.prompt is None and args.prompts_file is None:
        print(f"no --prompt given; using the demo prompt: {DEMO_PROMPT!r}", file=sys.stderr)
        args.prompt = DEMO_PROMPT
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
    )
    file_prompts = read_prompts_file(args.prompts_file) if args.prompts_file else None
    llm = LLM(model=args.model, **_engine_options(args))
    if file_prompts is not None:
        ids = _encode_file_prompts(llm, file_prompts, args.prompts_file)
        start = time.perf_counter()
        try:
            outputs = llm.generate(ids, params, use_tqdm=args.progress)
        finally:
            llm.close()
        elapsed = time.perf_counter() - start
        lines = [json.dumps({"token_ids": o.token_ids, "text": o.text, "metrics": o.metrics}) for o in outputs]
        if args.output:
            args.output.write_text("".join(line + "\n" for line in lines))
        else:
            print("\n".join(lines))
        agg = aggregate_metrics(outputs)
        generated = agg["num_generated_tokens"]
        summary = f"{len(outputs)} prompts, {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.1f} tok/s)"
        if "mean_accepted_length" in agg:
            summary += (f"; SD: {agg['draft_tokens_accepted']}/{agg['draft_tokens_proposed']} drafts accepted, "
                        f"mean accepted length {agg['mean_accepted_length']:.2f}")
        if "ssd_cache_hit_rate" in agg:
            summary += f"; SSD cache hit rate {agg['ssd_cache_hit_rate']:.2f}"
        print(summary, file=sys.stderr)
        _print_auto_k(llm)
        return 0
    if args.raw or llm.tokenizer is None or not llm.tokenizer.has_chat_template():
        ids = llm.encode(args.prompt)
    else:
        ids = llm.encode_chat([{"role": "user", "content": args.prompt}])
    try:
        for piece in llm.stream(ids, params):
            print(piece, end="", flush=True)
        print()
    finally:
        llm.close()
    out = llm.last_output
    m = out.metrics
    extra = ""
    if m.get("mean_accepted_length") is not None:
        extra += f", mean accepted length {m['mean_accepted_length']:.2f}"
    if m.get("ssd_cache_hit_rate") is not None:
        extra += f", SSD cache hit rate {m['ssd_cache_hit_rate']:.2f}"
    print(f"[{m['num_generated_tokens']} tokens, {m['time_s']:.2f} s, "
          f"{m['num_generated_tokens'] / m['time_s']:.1f} tok/s, finish: {out.finish_reason}{extra}]", file=sys.stderr)
    _print_auto_k(llm)
    if args.output:
        args.output.write_text(json.dumps({"token_ids": out.token_ids, "text": out.text, "metrics": m}) + "\n")
    return 0


def _print_auto_k(llm) -> None:
    auto_k = getattr(llm.engine.step_strategy, "auto_k", None)
    if auto_k is not None:
        print(f"k auto chose {auto_k.explain()}", file=sys.stderr)


def cmd_models(args: argparse.Namespace) -> int:
    from specfork.loading.resolve import ALIASES, SHIPPED_DRAFTS, resolve_checkpoint, shipped_drafts_dir

    for alias in ALIASES:
        try:
            where = str(resolve_checkpoint(alias).path)
        except SpecforkError as e:
            where = f"unavailable: {e}"
        print(f"{alias}\t{where}")
        for target, draft in SHIPPED_DRAFTS.items():
            if where.endswith(target):
                print(f"  default draft\t{shipped_drafts_dir() / draft}")
    return 0


def cmd_build_kernels(args: argparse.Namespace) -> int:
    import threading

    from specfork.layers import cpu_kernels

    library = cpu_kernels.library_path()
    if library.exists():
        print(f"native CPU kernels: already built for this torch and these sources ({library.parent})")
        return 0 if cpu_kernels.kernels() is not None else 1
    total = len(cpu_kernels.SOURCES)
    print(f"compiling the native CPU kernels: {total} C++ sources, about 2 minutes on 2 cores, once "
          f"(cached in {library.parent})", flush=True)
    start = time.perf_counter()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(cpu_kernels.kernels()), daemon=True)
    worker.start()
    shown = -1
    while worker.is_alive():
        worker.join(timeout=15.0)
        done = cpu_kernels.compiled_sources(library.parent)
        if worker.is_alive() and (done != shown or int(time.perf_counter() - start) % 60 < 15):
            print(f"  {done}/{total} sources compiled, {time.perf_counter() - start:.0f} s", flush=True)
            shown = done
    if result and result[0] is not None:
        print(f"native CPU kernels built in {time.perf_counter() - start:.0f} s")
        return 0
    print("native CPU kernels could not be built (see the warning above); specfork will use slower "
          "PyTorch paths", file=sys.stderr)
    return 1


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specfork.training.pipeline import TrainDraftJob, train_draft
    from specfork.training.settings import DataSettings, DraftArch, TrainSettings

    job = TrainDraftJob(
        target=args.target,
        output=args.output,
        work_dir=args.work_dir or args.output.with_name(args.output.name + ".work"),
        data=DataSettings(
            num_prompts=args.num_prompts, code_fraction=args.code_fraction, max_new_tokens=args.max_new_tokens,
            max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
        ),
        arch=DraftArch(
            hidden_size=args.hidden_size, num_layers=args.layers, intermediate_size=args.intermediate_size,
            num_heads=args.heads, num_kv_heads=args.kv_heads,
        ),
        train=TrainSettings(
            epochs=args.epochs, batch_tokens=args.batch_tokens, max_seq_len=args.max_seq_len, lr=args.lr,
            warmup_steps=args.warmup_steps, checkpoint_every=args.checkpoint_every, seed=args.seed,
        ),
        device=args.device,
        threads=args.threads,
        generation_batch=args.generation_batch,
        eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        progress=args.progress,
    )
    result = train_draft(job, command=args.command_line)
    print(json.dumps({k: result[k] for k in ("first_loss", "last_loss", "eval_top1_agreement", "acceptance")
                      if k in result}, indent=2))
    print(f"draft written to {args.output}", file=sys.stderr)
    return 0


def cmd_export_gguf(args: argparse.Namespace) -> int:
    from specfork.loading.gguf_export import export_gguf

    vocab_from = args.vocab_from
    provenance = Path(args.checkpoint) / "specfork_draft.json"
    if vocab_from is None and provenance.is_file():
        from specfork.loading.resolve import CheckpointFormat, resolve_checkpoint

        target = json.loads(provenance.read_text()).get("target")
        if target and resolve_checkpoint(target).format is CheckpointFormat.GGUF:
            vocab_from = target
    path = export_gguf(args.checkpoint, args.output, vocab_from=vocab_from, out_type=args.outtype)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specfork.bench.report import format_table, write_all
    from specfork.bench.runner import parse_sweep, run_benchmark
    from specfork.bench.settings import DATASETS, BenchSettings

    def split(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    datasets = DATASETS if args.datasets == "all" else split(args.datasets)
    settings = BenchSettings(
        model=args.model, draft=args.draft, modes=split(args.modes), datasets=datasets,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        temperature=args.temperature, k=args.k, fan_out=args.fan_out, backup=args.backup,
        batch_size=args.batch_size, threads=args.threads, repeat=args.repeat, warmup=args.warmup,
        peers=split(args.peers), target_cores=args.target_cores, draft_cores=args.draft_cores,
        bandwidth=args.bandwidth,
    )
    report = run_benchmark(settings, parse_sweep(args.sweep), progress=args.progress)
    command = args.command_line
    print(format_table(report))
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    paths = write_all(report, args.out, command)
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from specfork.llm import LLM
    from specfork.serve.server import ServerSettings, serve

    settings = ServerSettings(
        host=args.host, port=args.port, max_queue=args.max_queue, served_model_name=args.served_model_name,
        graceful_timeout_s=args.graceful_timeout, log_level=args.log_level.lower(),
        max_request_bytes=args.max_request_bytes, api_key=args.api_key or os.environ.get("SPECFORK_API_KEY") or None,
    )
    options = _engine_options(args)
    print(f"loading {args.model} ({args.mode}) ...", file=sys.stderr, flush=True)
    try:
        serve(lambda: LLM(args.model, **options), args.model, settings,
              on_ready=lambda url: print(f"specfork serving {args.model} at {url}/v1 (Ctrl-C to stop)",
                                         file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("specfork server stopped (interrupted)", file=sys.stderr)
        _exit_now(130)
    print("specfork server stopped", file=sys.stderr)
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """End the process without the interpreter's teardown. The server has already stopped its
    engine and drafter; unloading torch and the model's objects would take seconds more."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specfork.bench.serve_bench import (
        ServeBenchSettings,
        parse_rates,
        run_serve_benchmark,
        table,
        write_results,
    )

    settings = ServeBenchSettings(
        base_url=args.base_url.rstrip("/"), label=args.label, request_rates=parse_rates(args.request_rate),
        dataset=args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, seed=args.seed,
    )
    run = run_serve_benchmark(settings, progress=args.progress)
    print(table([run]))
    paths = write_results(run, args.out)
    print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["specfork", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        commands = {"generate": cmd_generate, "models": cmd_models, "build-kernels": cmd_build_kernels, "train-draft": cmd_train_draft, "export-gguf": cmd_export_gguf,
                    "bench": cmd_bench, "serve": cmd_serve, "bench-serve": cmd_bench_serve}
        return commands[args.command](args)
    except SpecforkError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
