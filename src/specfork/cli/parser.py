"""What every command's parser shares: one-line errors and the engine's options."""

from __future__ import annotations

import argparse

from specfork.cli import schema
from specfork.config import Config

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where to read more, not the usage block."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Every ``Config`` field, under the headings the fields name."""
    schema.add_options(parser, Config)


def engine_options(args: argparse.Namespace) -> dict:
    """The parsed engine options as ``Config`` keyword arguments (``model`` included)."""
    return schema.values(args, Config)
