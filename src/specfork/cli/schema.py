"""Command-line options generated from a settings dataclass's fields (``specfork.options``):
the option's name, type, default, choices, help text and ``--help`` heading all come from the
field, so the command line never re-declares them."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from specfork.options import flag_of

_TYPES = {"int": int, "float": float, "str": str}


def cli_fields(cls: type, exclude: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """The fields of ``cls`` offered on the command line."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True) and f.name not in exclude]


def add_options(parser: argparse.ArgumentParser, cls: type, *, exclude: tuple[str, ...] = (),
                defaults: dict[str, Any] | None = None, group: str | None = None) -> None:
    """One option per field of ``cls`` (``--field-name`` unless the field names its flag).

    defaults: command-specific defaults that replace the dataclass's (e.g. greedy sampling for
    ``generate``). group: the ``--help`` heading of fields that name none.
    """
    defaults = defaults or {}
    groups: dict[str | None, Any] = {}
    for f in cli_fields(cls, exclude):
        meta = f.metadata
        heading = meta.get("group") or group
        if heading not in groups:  # a heading an earlier call made is reused: one heading, one group in --help
            existing = [g for g in parser._action_groups if g.title == heading] if heading else []
            groups[heading] = existing[0] if existing else parser.add_argument_group(heading) if heading else parser
        default = defaults.get(f.name, _default(f))
        flag = flag_of(f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": _help(meta.get("help", ""), default)}
        if meta.get("flag"):
            kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
        if _base_type(f) == "bool":
            kwargs.pop("metavar", None)
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif meta.get("repeat"):
            kwargs.update(action="append", default=list(default), help=meta.get("help", "").replace("%", "%%"))
        else:
            kwargs["type"] = _reader(f)
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
        groups[heading].add_argument(flag, **kwargs)


def values(args: argparse.Namespace, cls: type, *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parsed values of ``cls``'s options, as keyword arguments for ``cls``."""
    return {f.name: tuple(value) if isinstance(value := getattr(args, f.name), list) else value
            for f in cli_fields(cls, exclude)}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _base_type(f: dataclasses.Field) -> str:
    """"int | None" -> "int"; the annotation as written (modules use postponed annotations)."""
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    return parts[0] if len(parts) == 1 else annotation


def _reader(f: dataclasses.Field):
    parse = f.metadata.get("parse")
    if parse is None:
        base = _base_type(f)
        if base not in _TYPES:
            raise TypeError(f"field {f.name} ({f.type}) needs option(parse=...) to be read from the command line")
        return _TYPES[base]

    def read(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    read.__name__ = f.name  # argparse names the option's type in its errors
    return read


def _help(text: str, default: Any) -> str:
    text = text.replace("%", "%%")  # argparse formats help with %
    if "(default" in text or default is None or default is False:
        return text
    if default is True:
        shown = "on"
    elif isinstance(default, tuple):
        shown = ",".join(str(x) for x in default) or "none"
    else:
        shown = str(default)
    return f"{text} (default: {shown})"
