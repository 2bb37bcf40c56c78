"""Options described once. A settings dataclass declares each field with :func:`option`: its
default, its help text, its choices and how a command line reads it. ``specfork.cli.schema``
builds the command-line options from those fields, so no default or choice is written twice.
Importing this costs nothing (no torch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: tuple | None = None,
    parse: Callable[[str], Any] | None = None,
    flag: str | None = None,
    group: str | None = None,
    cli: bool = True,
    repeat: bool = False,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with what the command line needs to offer it.

    help: one phrase; "(default: ...)" is added from the default unless the text says it.
    choices: the accepted values (the command line refuses others with a one-line error).
    parse: text -> value for types the command line cannot infer ("auto", comma lists); it
        raises ValueError with a message for bad text.
    flag: the option's name when it is not ``--field-name`` (e.g. ``--drafter-timeout``).
    group: the heading the option is listed under in ``--help``.
    cli: False keeps the field off the command line (set by code, not by users).
    repeat: the option may be given several times; the values are collected (a tuple field).
    """
    metadata = {"help": help, "choices": choices, "parse": parse, "flag": flag, "group": group, "cli": cli,
                "repeat": repeat}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of an option field (``--field-name`` unless ``flag`` says otherwise)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def only_for(flags: list[str], where: str) -> str:
    """The message refusing options that ``where`` alone reads ("--k only applies to --mode sd")."""
    return f"{', '.join(flags)} only {'applies' if len(flags) == 1 else 'apply'} to {where}"


def int_or_auto(text: str) -> int | str:
    """An integer, or the word auto."""
    return _number_or_auto(text, int, "an integer", "auto")


def seconds_or_auto(text: str) -> float | None:
    """A number of seconds, or auto (None: the code decides)."""
    return _number_or_auto(text, float, "a number of seconds", None)


def _number_or_auto(text: str, kind: type, what: str, auto: Any) -> Any:
    if text == "auto":
        return auto
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"must be {what} or auto, got {text!r}") from None


def on_off(text: str) -> bool:
    """on/off (also true/false, yes/no, 1/0) -> bool."""
    value = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False,
             "0": False}.get(text.strip().lower())
    if value is None:
        raise ValueError(f"must be on or off, got {text!r}")
    return value


def comma_list(text: str) -> tuple[str, ...]:
    """"a, b,c" -> ("a", "b", "c"); a repeated item counts once ("a,a" -> ("a",))."""
    return tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
