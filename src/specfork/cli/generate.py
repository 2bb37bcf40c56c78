"""``specfork generate``: one prompt streamed to the terminal, or a JSONL file of prompts batched."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specfork.cli import schema
from specfork.cli.parser import add_engine_options, engine_options
from specfork.errors import PromptError, SpecforkError
from specfork.output_paths import check_output_file
from specfork.sampling_params import SamplingParams

DEMO_PROMPT = "Write a Python function that checks whether a number is prime."
SAMPLING_DEFAULTS = {"temperature": 0.0, "max_tokens": 256}  # the command line is greedy unless told
HELP = "generate text for one prompt or a JSONL file of prompts"
DESCRIPTION = (
    "Generate text. With --prompt the reply streams to the terminal; with "
    "--prompts-file every line is one request and all run batched together."
)
EPILOG = (
    "prompts file lines (JSON objects; other keys are ignored):\n"
    '  {"prompt": "raw text"}            tokenized as the tokenizer says, no chat template\n'
    '  {"messages": [{"role": "user", "content": "..."}]}   chat template applied\n'
    '  {"token_ids": [1, 2, 3]}          used as given\n'
    "output lines (--output): {\"token_ids\": [...], \"text\": \"...\", \"metrics\": {...}} in input order"
)


def add_arguments(p) -> None:
    src = p.add_argument_group("prompts").add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt; chat-templated when the model has a template (see --raw); "
                     f"without --prompt and --prompts-file the demo prompt {DEMO_PROMPT!r} is used (and said)")
    src.add_argument("--prompts-file", type=Path, help="JSONL file of prompts (see below)")
    p.add_argument("--raw", action="store_true", help="with --prompt: use the text as is, without the chat template")
    p.add_argument("--output", type=Path, help="write one JSON line per prompt to this file")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bar for --prompts-file (default: on)")
    add_engine_options(p)
    schema.add_options(p, SamplingParams, defaults=SAMPLING_DEFAULTS, group="sampling")


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


def run(args: argparse.Namespace) -> int:
    from specfork import LLM

    if args.prompt == "":
        raise PromptError("prompt is empty")
    if args.raw and args.prompts_file is not None:
        raise SpecforkError("--raw is for --prompt; in a prompts file, {\"prompt\": ...} lines are raw text already "
                            "and {\"messages\": ...} lines are chat-templated")
    if args.prompt is None and args.prompts_file is None:
        print(f"no --prompt given; using the demo prompt: {DEMO_PROMPT!r}", file=sys.stderr)
        args.prompt = DEMO_PROMPT
    params = SamplingParams(**schema.values(args, SamplingParams))
    if args.output:
        check_output_file(args.output, "--output")
    file_prompts = read_prompts_file(args.prompts_file) if args.prompts_file else None
    llm = LLM(**engine_options(args))
    if file_prompts is not None:
        return _generate_file(llm, _encode_file_prompts(llm, file_prompts, args.prompts_file), params, args)
    return _generate_one(llm, params, args)


def _generate_file(llm, ids: list[list[int]], params: SamplingParams, args: argparse.Namespace) -> int:
    from specfork.outputs import aggregate_metrics

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


def _generate_one(llm, params: SamplingParams, args: argparse.Namespace) -> int:
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
    if llm.auto_k_choice is not None:
        print(f"k auto chose {llm.auto_k_choice}; `specfork --log-level info generate ...` logs the measured "
              "step costs behind it", file=sys.stderr)
