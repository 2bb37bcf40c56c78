"""The ``specfork`` command line. The only module that prints, reads the environment or
configures logging."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from specfork.config import DEFAULT_MODEL
from specfork.errors import SpecforkError

EXIT_BAD_INPUT = 2


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
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--mode", default="ar", choices=["ar", "sd"],
                   help="ar: autoregressive; sd: speculative decoding (a drafter proposes --k tokens, the "
                   "model verifies them in one pass; output distribution unchanged) (default: ar)")
    s.add_argument("--drafter", default="draft", choices=["draft", "ngram"],
                   help="SD proposer: a draft model (--draft) or n-gram prompt lookup (default: draft)")
    s.add_argument("--draft", default=None, help="draft model for --drafter draft: HF directory or .gguf file "
                   "sharing the target's vocabulary")
    s.add_argument("--k", type=int, default=5, help="tokens proposed per SD round (default: 5)")
    s.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched by --drafter ngram (default: 1)")
    s.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched by --drafter ngram (default: 4)")
    s.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: greedy SD output is bit-identical to AR output (slower)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed of every request (default: a per-request seed derived from 0)")


def _engine_options(args: argparse.Namespace) -> dict:
    return {
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
    parser = argparse.ArgumentParser(
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
    src.add_argument("--prompt", help="one prompt; chat-templated when the model has a template (see --raw)")
    src.add_argument("--prompts-file", type=Path, help="JSONL file of prompts (see below)")
    gen.add_argument("--raw", action="store_true", help="with --prompt: use the text as is, without the chat template")
    gen.add_argument("--output", type=Path, help="write one JSON line per prompt to this file")
    gen.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                     help="progress bar for --prompts-file (default: on)")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    return parser


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
            raise SpecforkError(f"{path}:{lineno}: not valid JSON: {e.msg}") from None
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
                ids.append(llm.engine.encode_prompt(p["prompt"]))
            elif "messages" in p:
                ids.append(llm.engine.encode_chat(p["messages"]))
            else:
                if not isinstance(p["token_ids"], list):
                    raise SpecforkError("'token_ids' must be a list of integers")
                ids.append(llm.engine.encode_prompt(p["token_ids"]))
        except SpecforkError as e:
            raise type(e)(f"{path}:{p['_line']}: {e}") from None
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    from specfork import LLM, SamplingParams
    from specfork.outputs import aggregate_metrics

    if args.prompt is None and args.prompts_file is None:
        args.prompt = "Write a Python function that checks whether a number is prime."
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=tuple(args.stop),
    )
    file_prompts = read_prompts_file(args.prompts_file) if args.prompts_file else None
    llm = LLM(model=args.model, **_engine_options(args))
    if file_prompts is not None:
        ids = _encode_file_prompts(llm, file_prompts, args.prompts_file)
        start = time.perf_counter()
        outputs = llm.generate(ids, params, use_tqdm=args.progress)
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
        print(summary, file=sys.stderr)
        return 0
    if args.raw or llm.tokenizer is None or not llm.tokenizer.has_chat_template:
        ids = llm.engine.encode_prompt(args.prompt)
    else:
        ids = llm.engine.encode_chat([{"role": "user", "content": args.prompt}])
    for piece in llm.stream(ids, params):
        print(piece, end="", flush=True)
    print()
    out = llm.last_output
    m = out.metrics
    print(f"[{m['num_generated_tokens']} tokens, {m['time_s']:.2f} s, "
          f"{m['num_generated_tokens'] / m['time_s']:.1f} tok/s, finish: {out.finish_reason}]", file=sys.stderr)
    if args.output:
        args.output.write_text(json.dumps({"token_ids": out.token_ids, "text": out.text, "metrics": m}) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return {"generate": cmd_generate}[args.command](args)
    except SpecforkError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
