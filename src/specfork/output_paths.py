"""Checks of the paths a command will write (CLI outputs, train-draft's directories), made
before its work starts, so that a path it cannot write is a one-line error up front rather than a
traceback after minutes of work."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from specfork.errors import SpecforkError


def check_output_file(path: Path, option: str) -> None:
    """A file the command will create or overwrite."""
    path = Path(path)
    if path.is_dir():
        raise SpecforkError(f"{option} {path} is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if parent.exists() and not parent.is_dir():
        raise SpecforkError(f"{option} {path}: {parent} is a file, not a directory")
    if not parent.is_dir():
        raise SpecforkError(f"{option} {path}: the directory {parent} does not exist")
    if not _can_create_in(parent) or (path.exists() and not os.access(path, os.W_OK)):
        raise SpecforkError(f"{option} {path}: not writable")


def check_output_directory(path: Path, option: str) -> None:
    """A directory the command will create if needed and write files into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise SpecforkError(f"{option} {path} is a file; give a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not _can_create_in(existing):
        raise SpecforkError(f"{option} {path}: cannot create or write it ({existing} is not a writable directory)")


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be created in ``directory``, tried (permission bits say yes to root
    everywhere, /proc included)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False
