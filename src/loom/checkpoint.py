"""Checkpoints: one directory per step, written atomically, verified on load.

Layout of `<run>/ckpt/step_000500/`:
  model.pt      the model's state_dict (tensors only)
  optim.pt      the optimizer's state_dict
  extra.pt      RNG states and other tensors (loss scaler)
  state.json    step, loader position, resolved config, anything JSON
  manifest.json size and SHA-256 of every file above, written last

Everything is written into `step_000500.tmp/` and renamed when complete, so a crash never leaves a half
checkpoint under a final name. Loading uses `torch.load(weights_only=True)`: no pickle code runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from loom import log
from loom.errors import LoomError

_STEP_RE = re.compile(r"^step_(\d{6,})$")
TENSOR_FILES = ("model.pt", "optim.pt", "extra.pt")


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save(ckpt_dir: str | Path, step: int, tensors: dict[str, Any], state: dict, keep_last: int) -> Path:
    """Write a checkpoint for `step`; `tensors` maps 'model'/'optim'/'extra' to state dicts."""
    final = step_dir(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in TENSOR_FILES:
        torch.save(tensors.get(name.removesuffix(".pt"), {}), tmp / name)
    (tmp / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
    (tmp / "manifest.json").write_text(json.dumps({"step": step, "files": files}, indent=1), encoding="utf-8")
    if final.exists():  # the same step saved again (e.g. the final step after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune(ckpt_dir, keep_last)
    return final


def list_steps(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoint directories under ckpt_dir, oldest first (temporary ones excluded)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def prune(ckpt_dir: str | Path, keep_last: int) -> None:
    for p in list_steps(ckpt_dir)[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)


def verify(path: str | Path) -> None:
    """Raise LoomError naming the problem if the checkpoint at `path` is missing, incomplete or corrupt."""
    path = Path(path)
    manifest = path / "manifest.json"
    if not manifest.is_file():
        raise LoomError(f"checkpoint '{path}' has no manifest.json (incomplete or not a checkpoint)")
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
        raise LoomError(f"checkpoint '{path}' has an unreadable manifest.json") from None
    for name, rec in files.items():
        f = path / name
        if not f.is_file():
            raise LoomError(f"checkpoint '{path}' is missing {name}")
        if f.stat().st_size != rec["bytes"]:
            raise LoomError(
                f"checkpoint file '{f}' has {f.stat().st_size} bytes, manifest says {rec['bytes']}"
            )
        if _sha256(f) != rec["sha256"]:
            raise LoomError(f"checkpoint file '{f}' does not match its SHA-256 in the manifest (corrupt)")


def latest_valid(ckpt_dir: str | Path) -> Path | None:
    """The newest checkpoint that verifies; corrupt newer ones are reported and skipped."""
    for p in reversed(list_steps(ckpt_dir)):
        try:
            verify(p)
            return p
        except LoomError as e:
            log.warn(f"skipping checkpoint: {e}")
    return None


def load(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict]:
    """Verify and load a checkpoint: (tensors by name, state.json)."""
    path = Path(path)
    verify(path)
    tensors = {
        name.removesuffix(".pt"): torch.load(path / name, map_location=map_location, weights_only=True)
        for name in TENSOR_FILES
    }
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    return tensors, state


def resolve_resume(run_dir: Path, resume: str | bool) -> Path:
    """`--resume` (True: newest valid in the run) or `--resume PATH` (a run dir or a step dir)."""
    target = Path(resume) if isinstance(resume, str) else run_dir
    if _STEP_RE.match(target.name) and target.is_dir():
        verify(target)
        return target
    ckpt_dir = target / "ckpt" if (target / "ckpt").is_dir() else target
    found = latest_valid(ckpt_dir)
    if found is None:
        raise LoomError(
            f"--resume: no valid checkpoint under '{ckpt_dir}'",
            hint="start without --resume, or point --resume at a run directory that has checkpoints",
        )
    return found
