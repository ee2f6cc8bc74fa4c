"""Rank-aware logging (layer 0): rank 0 prints by default; every rank may also write its own file."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

_state = {"rank": 0, "all_ranks": False, "file": None, "console": None}


def setup(
    rank: int = 0, all_ranks: bool = False, file: str | Path | None = None, stderr: bool = False
) -> None:
    """Configure this process's logging: which rank it is, whether it prints, an optional log file, and
    whether the console lines go to stderr (a command whose stdout is its result, as `loom generate`)."""
    _state["rank"], _state["all_ranks"] = rank, all_ranks
    if stderr:
        from rich.console import Console

        _state["console"] = Console(highlight=False, soft_wrap=True, stderr=True)
    if _state["file"] is not None:
        _state["file"].close()
        _state["file"] = None
    if file is not None:
        Path(file).parent.mkdir(parents=True, exist_ok=True)
        _state["file"] = open(file, "a", encoding="utf-8", buffering=1)


def console():
    """The rich console (created lazily; plain text when stdout is not a terminal)."""
    if _state["console"] is None:
        from rich.console import Console

        _state["console"] = Console(highlight=False, soft_wrap=True)
    return _state["console"]


def print_table(table, con=None) -> None:
    """A rich table printed whole (rank 0's console, or `con`). Every table of loom goes through here.

    A terminal gets the table at its width, and a column too narrow for a cell folds it onto more lines
    (rich's default cuts it with '…', which loses the digits of a number). A file or a pipe has no width
    to respect, so the table is printed at its natural width: rich caps a console that is not a terminal at
    80 columns (or $COLUMNS), and asking `print(width=132)` cannot go above that cap."""
    con = con or console()
    for col in table.columns:
        # fold, never cut; no_wrap would keep a cell on one line and cut it anyway when it does not fit
        col.overflow, col.no_wrap = "fold", False
    if con.is_terminal:
        con.print(table)
        return
    from rich.console import Console
    from rich.measure import Measurement

    natural = Measurement.get(con, con.options.update_width(100_000), table).maximum
    # a console of that width on the same stream (con.file follows a redirected sys.stdout / sys.stderr)
    Console(file=con.file, width=max(natural, con.width), highlight=False, no_color=True).print(table)


def _prints() -> bool:
    return _state["rank"] == 0 or _state["all_ranks"]


def prints_console() -> bool:
    """Whether this process's lines reach the console (rank 0, or every rank with all_ranks)."""
    return _prints()


def shows_all_ranks() -> bool:
    """Whether every rank prints (lines prefixed by their rank): no single progress line then."""
    return bool(_state["all_ranks"])


def info(msg: str, *, style: str | None = None) -> None:
    """A line on the console (rank 0, or every rank prefixed when all_ranks) and in the rank's log file."""
    if _state["file"] is not None:
        _state["file"].write(msg + "\n")
    if not _prints():
        return
    text = f"[rank{_state['rank']}] {msg}" if _state["all_ranks"] else msg
    console().print(text, style=style, markup=False)


def warn(msg: str) -> None:
    info(f"warning: {msg}", style="yellow")


_warned: set[str] = set()


def warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warn(msg)


def error(msg: str) -> None:
    """Errors go to stderr from every rank (a failure on rank 3 must not be silent)."""
    print(msg, file=sys.stderr, flush=True)
    if _state["file"] is not None:
        _state["file"].write(msg + "\n")


# What other libraries print that loom triggers and a user cannot act on; `loom --verbose` or LOOM_DEBUG=1 shows it.
_NOISY_LOGGERS = (
    "torchao",  # "Failed to load ..._C_mxfp8.cpython-310-...so": CUDA kernel libraries a CPU build lacks
    "torch.utils._pytree",  # torch 2.13: torchao registers an Enum as a pytree constant (deprecated there)
)
# Deprecations inside the libraries loom calls (torch's DTensor calls its own deprecated all_gather_tensor, on
# every rank): attributed to their modules, or naming torch; loom's own calls are kept up to date by its tests
_NOISY_MODULES = r"(torch|torchao|transformers|accelerate|datasets|lm_eval)(\.|$)"


def debug_enabled() -> bool:
    """LOOM_DEBUG=1 (or `loom --verbose`, which sets it for every process the command starts)."""
    return os.environ.get("LOOM_DEBUG", "") not in ("", "0")


@contextlib.contextmanager
def without_native_lines(prefix: str):
    """Drop the lines starting with `prefix` that native code writes to the process's stderr (file descriptor
    2, which Python's warnings filters never see) inside the block, and pass every other line on after it:
    kineto prints "USDT: ... profiler_start/stop" at each profiler start and stop whatever KINETO_LOG_LEVEL
    says. Nothing is dropped with LOOM_DEBUG=1. For short calls only: the lines come out after the block."""
    if debug_enabled():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                ln
                for ln in held.read().decode(errors="replace").splitlines(True)
                if not ln.startswith(prefix)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def quiet_third_party() -> None:
    """Filter, once at the command's start, the third-party noise loom triggers and cannot act on: warnings
    filters and logging levels here, nowhere else. Nothing is filtered with LOOM_DEBUG=1."""
    if debug_enabled():
        return
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=_NOISY_MODULES)
        warnings.filterwarnings("ignore", message=r".*\btorch\.", category=category)
    # the profiler's (kineto's) progress lines: "Completed Stage: Warm Up" and the like; read when it starts
    os.environ.setdefault("KINETO_LOG_LEVEL", "4")
