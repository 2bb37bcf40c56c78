"""What every command's parser shares: one-line errors and the engine's options."""

from __future__ import annotations

import argparse
import difflib

from specfork.cli import schema
from specfork.config import Config

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the problem and where to read more, not the usage block.
    An option must be spelled in full: argparse's prefix matching turned ``--output DIR`` into
    ``--output-len DIR`` (an "invalid int" error about an option never typed) and would silently
    change meaning whenever a new option shares a prefix. An unknown option names its nearest
    spellings."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        unknown = [a.split("=", 1)[0] for a in extras if a.startswith("--")]
        if unknown and self._subparsers is None:  # a command's parser: it knows its own options
            hints = [f"{a} (did you mean {' or '.join(m)}?)" if (m := self._nearest(a)) else a for a in unknown]
            self.error(f"unrecognized option{'s' if len(hints) > 1 else ''}: {', '.join(hints)}")
        return parsed, extras

    def _nearest(self, option: str) -> list[str]:
        names = [o for o in self._option_string_actions if o.startswith("--")]
        close = difflib.get_close_matches(option, names, n=2, cutoff=0.75)
        prefixed = [o for o in names if o.startswith(option) or option.startswith(o)]
        return list(dict.fromkeys(close + sorted(prefixed, key=len)))[:2]

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Every ``Config`` field, under the headings the fields name."""
    schema.add_options(parser, Config)


def engine_options(args: argparse.Namespace) -> dict:
    """The parsed engine options as ``Config`` keyword arguments (``model`` included)."""
    return schema.values(args, Config)
