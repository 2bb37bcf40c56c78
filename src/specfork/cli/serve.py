"""``specfork serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from specfork.cli import schema
from specfork.cli.parser import add_engine_options, engine_options
from specfork.serve.server import ServerSettings

HELP = "OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)"
DESCRIPTION = (
    "Serve the model over an OpenAI-compatible API: GET /v1/models, POST /v1/completions, "
    "POST /v1/chat/completions (stream: true for server-sent events), GET /health, GET /metrics "
    "(Prometheus). All requests share one engine with continuous batching; every mode and "
    "speculative option of `generate` applies. SIGINT/SIGTERM stop it gracefully."
)


def add_arguments(p) -> None:
    schema.add_options(p, ServerSettings, group="server")
    add_engine_options(p)


def run(args: argparse.Namespace) -> int:
    from specfork.config import Config
    from specfork.llm import LLM
    from specfork.serve.server import serve

    options = schema.values(args, ServerSettings)
    if options["api_key"] is None:  # an empty --api-key "$UNSET" is refused, never taken as no key
        options["api_key"] = os.environ.get("SPECFORK_API_KEY")
    settings = ServerSettings(**options, log_level=args.log_level.lower())
    engine = engine_options(args)
    model = engine["model"]
    Config(**engine)  # the options checked before "loading" is printed
    print(f"loading {model} ({args.mode}) ...", file=sys.stderr, flush=True)
    try:
        serve(lambda: LLM(**engine), model, settings,
              on_ready=lambda url: print(f"specfork serving {model} at {url}/v1 (Ctrl-C to stop)",
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
