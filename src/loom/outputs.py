"""Output folders loom writes, and the only way `--force` may replace one (layer 0, no torch).

Every folder loom creates (a prepared data set, a run, an export, a consolidated model) carries a marker
file, `.loom-output`, holding one JSON line that names its kind. `--force` replaces a folder only when it
is loom's own output of the same kind: with the marker, or (folders written before the marker existed)
with nothing in it but what loom writes there. Anything else is refused with a hint, and so is an output
that is, contains or lies inside one of the command's inputs: `loom export RUN --out RUN --force` or
`loom data prepare --input DIR --out DIR --force` must never delete what they read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from loom.errors import LoomError

MARKER = ".loom-output"
KINDS = {
    "data": "a prepared data set",
    "run": "a training run",
    "export": "an exported model",
    "consolidated": "a consolidated model (loom ckpt consolidate)",
}

# What loom writes into each kind of folder, to recognise folders from before the marker existed.
_RUN_ENTRIES = {
    "config.toml",
    "run.json",
    "metrics.jsonl",
    "samples.txt",
    "tokenizer",
    "ckpt",
    "logs",
    "tensorboard",
    "wandb",
    "loss.png",
}
_EXPORT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
}
_CONSOLIDATED_ENTRIES = {"model.safetensors", "config.toml", "run.json", "tokenizer"}


def write_marker(directory: str | Path, kind: str) -> None:
    """Mark `directory` as loom's output of `kind` (data, run or export)."""
    assert kind in KINDS, kind
    from loom import __version__

    line = json.dumps({"kind": kind, "loom_version": __version__})
    (Path(directory) / MARKER).write_text(line + "\n", encoding="utf-8")


def _legacy_kind(d: Path) -> str | None:
    """The kind of an unmarked folder whose contents are exactly what loom writes there, else None."""
    entries = list(d.iterdir())
    names = {p.name for p in entries}
    if "config.toml" in names and names <= _RUN_ENTRIES and names & {"metrics.jsonl", "ckpt", "run.json"}:
        return "run"
    if "meta.json" in names and all(
        p.is_file() and (p.name.startswith(("train", "val")) or p.name in _data_extras(d)) for p in entries
    ):
        return "data"
    if "model.safetensors" in names and names <= _EXPORT_FILES and all(p.is_file() for p in entries):
        return "export"
    if {"model.safetensors", "config.toml"} <= names <= _CONSOLIDATED_ENTRIES:
        return "consolidated"
    if names and names <= {"base", "adapter"} and all(output_kind(d / n) == "export" for n in names):
        return "export"  # a peft export written before its folder was marked as a whole
    return None


def _data_extras(d: Path) -> set[str]:
    """The files a data folder holds besides its shards: meta.json, nanogpt's meta.pkl, the tokenizer."""
    extras = {"meta.json", "meta.pkl"}
    try:
        tok = json.loads((d / "meta.json").read_text(encoding="utf-8")).get("tokenizer") or {}
        if isinstance(tok, dict) and isinstance(tok.get("file"), str):
            extras.add(tok["file"])
    except (OSError, ValueError, AttributeError):
        pass
    return extras


def output_kind(directory: str | Path) -> str | None:
    """data, run or export when `directory` is loom's output (marked, or recognised by its contents)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    marker = d / MARKER
    if marker.is_file():
        try:
            kind = json.loads(marker.read_text(encoding="utf-8").strip() or "{}").get("kind")
        except (OSError, ValueError, AttributeError):
            kind = None
        return kind if kind in KINDS else None
    return _legacy_kind(d)


def check_apart(
    out: str | Path, inputs: Iterable[str | Path], option: str = "--out", inside_ok: bool = False
) -> None:
    """Refuse an output that is, contains or (unless inside_ok) lies inside one of the inputs (real paths,
    links resolved). inside_ok: the command reads only named files of its input folder (a data set's
    shards, a run's checkpoint), so an output folder beside them is never read back."""
    o = Path(os.path.realpath(out))
    for inp in inputs:
        i = Path(os.path.realpath(inp))
        if i == o or o in i.parents:
            what = "is" if i == o else "contains"
            raise LoomError(
                f"{option} '{out}' {what} the input '{inp}': writing there would replace what is being read",
                hint=f"choose an {option} outside the inputs",
            )
        if i in o.parents and not inside_ok:
            raise LoomError(
                f"{option} '{out}' lies inside the input '{inp}'",
                hint=f"choose an {option} outside the inputs, so that the output is never read back as input",
            )


def check_replaceable(out: str | Path, kind: str, force: bool, option: str = "--out") -> bool:
    """Whether `out` must be replaced (True) or is free (False: missing or empty); refuses everything else.

    A non-empty folder is replaced only with `force` and only when it is loom's own output of `kind`."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise LoomError(
            f"{option} '{out}' is a file, not a directory", hint=f"choose a directory path for {option}"
        )
    if not out.exists() or not any(out.iterdir()):
        return False
    if not force:
        raise LoomError(
            f"output directory '{out}' already exists and is not empty",
            hint=f"choose another {option}, or pass --force to replace it",
        )
    found = output_kind(out)
    if found == kind:
        return True
    if found is not None:
        raise LoomError(
            f"--force will not replace '{out}': it holds {KINDS[found]}, not {KINDS[kind]}",
            hint=f"choose another {option}",
        )
    raise LoomError(
        f"--force will not replace '{out}': it is not a folder loom wrote (no {MARKER} marker, and it holds "
        f"files loom does not write there)",
        hint=f"choose another {option}, or move or delete the folder yourself if it can go",
    )


def replace_output(out: str | Path, kind: str, force: bool, option: str = "--out") -> None:
    """Delete `out` when check_replaceable allows it (loom's own output of `kind`, with --force)."""
    if check_replaceable(out, kind, force, option):
        shutil.rmtree(out)


def claim_output(
    out: str | Path,
    kind: str,
    force: bool,
    option: str = "--out",
    inputs: Iterable[str | Path] = (),
    inside_ok: bool = False,
) -> None:
    """check_apart, then replace_output: an output folder made ready in one call (apart from its inputs, and
    free, or loom's own output of `kind` replaced with --force)."""
    check_apart(out, inputs, option, inside_ok)
    replace_output(out, kind, force, option)


def disk_full(e: BaseException) -> bool:
    """Whether `e` is the filesystem out of space: an OSError ENOSPC / EDQUOT (write() gives it without a file
    name), or a writer outside Python reporting it in its message (safetensors' Rust error: "I/O error: No
    space left on device (os error 28)", a SafetensorError, not an OSError)."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    text = str(e)
    return "No space left on device" in text or "Disk quota exceeded" in text


@contextlib.contextmanager
def staged_output(out: str | Path, kind: str, force: bool, option: str = "--out") -> Iterator[Path]:
    """A folder that appears whole or not at all: the caller writes into the temporary folder yielded
    (`.<name>.loom-tmp` beside `out`, so the rename stays on one filesystem), which replaces `out` only once
    the block ends. check_replaceable's rule is applied before anything is written, and an earlier output that
    --force replaces is kept until then. When the block fails, the temporary folder is removed (nothing half
    written is left looking complete); a full disk becomes one LoomError naming `out` and what to do."""
    out = Path(out)
    had = check_replaceable(out, kind, force, option)
    tmp = out.with_name(f".{out.name}.loom-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
        replace_output(out, kind, force, option)
        if out.is_dir():  # empty (check_replaceable allowed it): a rename replaces only an empty folder
            out.rmdir()
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and disk_full(e):
            kept = f"; what it held before ({KINDS[kind]}) is untouched" if had else ""
            raise LoomError(
                f"could not write {option} '{out}': the disk is full (No space left on device); the partly "
                f"written output was removed{kept}",
                hint=f"free some space, or give another {option} on a disk with room, and run it again",
            ) from None
        raise
