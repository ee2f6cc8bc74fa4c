"""Checks of the paths a command reads and writes, made before any work (layer 0, no torch).

An output that cannot be written (a folder this user may not write, a path through a regular file) and an
input that never ends (a character device such as /dev/zero, a FIFO) are refused with a message that
names the path, instead of a traceback after the expensive part, or a read that never returns.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from loom.errors import LoomError


def cache_dir() -> Path:
    """loom's cache (built-in corpora, measured CPU peaks, alignment indexes): $LOOM_CACHE_DIR, else
    ~/.cache/loom."""
    return Path(os.environ.get("LOOM_CACHE_DIR") or Path.home() / ".cache" / "loom")


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_parent(path: Path, option: str) -> None:
    """The folder that will hold `path` (or the nearest ancestor that exists) must be a writable folder."""
    parent = _nearest_existing(path.parent if str(path.parent) else Path("."))
    if not parent.is_dir():
        raise LoomError(
            f"{option} '{path}' cannot be created: '{parent}' is a file, not a directory",
            hint=f"choose another {option}",
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise LoomError(
            f"{option} '{path}' is not writable ('{parent}' denies this user write access)",
            hint=f"choose a writable {option}, or fix the folder's permissions",
        )


def check_output_dir(path: str | Path, option: str = "--out", temp_beside: bool = False) -> None:
    """A folder a command will create or write into: an existing one must be a writable directory, a new
    one must be creatable (its nearest existing ancestor a writable directory). temp_beside: the command
    writes a temporary folder next to it and renames it, so its parent must be writable too."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise LoomError(
                f"{option} '{p}' is a file, not a directory", hint=f"choose a directory path for {option}"
            )
        if not os.access(p, os.W_OK | os.X_OK):
            raise LoomError(
                f"{option} '{p}' is not writable (this user may not write into it)",
                hint=f"choose a writable {option}, or fix the folder's permissions",
            )
        if not temp_beside:
            return
    _check_parent(p, option)


def check_output_file(path: str | Path, option: str = "--out") -> None:
    """A file a command will write: not a directory, not a device, and its folder writable."""
    p = Path(path)
    if p.is_dir():
        raise LoomError(f"{option} '{p}' is a directory, not a file", hint=f"give a file name for {option}")
    if p.exists() and not p.is_file():
        raise LoomError(f"{option} '{p}' is not a regular file", hint=f"give a file name for {option}")
    if p.exists() and not os.access(p, os.W_OK):
        raise LoomError(
            f"{option} '{p}' is not writable (this user may not replace it)", hint=f"choose another {option}"
        )
    _check_parent(p, option)


def check_not_endless(path: str | Path, what: str) -> None:
    """Refuse an input that is neither a regular file nor a folder: a device (/dev/zero, /dev/urandom), a
    FIFO or a socket would be read without end or block. A missing path is left to the caller."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
        kind = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else kind
        raise LoomError(
            f"{what} '{p}' is {kind}: it would be read without end", hint=f"give a regular file as {what}"
        )
