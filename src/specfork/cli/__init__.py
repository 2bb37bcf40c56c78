"""The ``specfork`` command line: one module per command, each with ``HELP``, ``DESCRIPTION``
(and ``EPILOG``), ``add_arguments(parser)`` when it takes options, and ``run(args)``.
The only package that prints, reads the environment or configures logging. Importing it loads
no torch, so ``specfork --help`` answers at once."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import threading
from contextlib import contextmanager

from specfork.cli import bench, bench_serve, build_kernels, export_gguf, generate, models, serve, train_draft
from specfork.cli.parser import EXIT_BAD_INPUT, Parser
from specfork.errors import EngineFailure, SpecforkError

COMMANDS = {
    "generate": generate,
    "serve": serve,
    "bench": bench,
    "bench-serve": bench_serve,
    "train-draft": train_draft,
    "export-gguf": export_gguf,
    "models": models,
    "build-kernels": build_kernels,
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_LEVEL_HELP = "logging level: debug, info, warning, error, critical (default: warning)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specfork")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="specfork",
        description="specfork: exact speculative decoding (AR, SD and SSD). "
        "Run `specfork generate` to generate with the embedded SmolLM2-135M model.",
    )
    parser.add_argument("--log-level", default="WARNING", help=LOG_LEVEL_HELP)
    parser.add_argument("--version", action="version", version=f"specfork {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        epilog = getattr(command, "EPILOG", None)
        p = sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter if epilog else argparse.HelpFormatter)
        if hasattr(command, "add_arguments"):
            command.add_arguments(p)
        # also after the command (`specfork generate --log-level info`); unset there, the value
        # before the command (or its default) stands
        p.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
    return parser


class Terminated(BaseException):
    """SIGTERM arrived (`kill`, `docker stop`, systemd): unwound like Ctrl-C, so that the
    engine's processes (SSD's drafter, tensor-parallel ranks) are stopped on the way out. A
    BaseException, as KeyboardInterrupt is: the engine's handling of a failed batch must not
    take it for one."""


@contextmanager
def _sigterm_raises():
    """SIGTERM raises :class:`Terminated` while a command runs (the server installs its own
    handler once it serves); the previous handler is back afterwards. Only the main thread can
    set a handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["specfork", *(sys.argv[1:] if argv is None else argv)])
    if args.log_level.upper() not in LOG_LEVELS:
        parser.error(f"--log-level: {args.log_level!r} is not one of {', '.join(LOG_LEVELS).lower()}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        with _sigterm_raises():
            return COMMANDS[args.command].run(args)
    except Terminated:
        sys.stdout.flush()
        print("\nterminated", file=sys.stderr)
        return 143
    except SpecforkError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except EngineFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr)  # on a line of its own, after any streamed text
        return 130
    except BrokenPipeError:  # the reader went away (`specfork models | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 141
