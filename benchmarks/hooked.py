"""Run `loom` in subprocesses with a measuring hook, shared by the benchmark scripts beside it.

The hook is Python source for a `sitecustomize` module put first on the children's PYTHONPATH, so it is
imported at interpreter start of every process (the launcher's and each rank's) and needs nothing from
loom: any checkout can be measured the same way (`src`). `PRELUDE` gives hooks `_loaded(module, attr)`, which
waits in a daemon thread until loom has imported the class to patch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

PRELUDE = """
import os, sys, threading, time, json

def _loaded(module, attr):
    while module not in sys.modules or not hasattr(sys.modules[module], attr):
        time.sleep(0.001)
    return getattr(sys.modules[module], attr)
"""


def run_hooked(
    hook: str, loom_args: list[str], env: dict[str, str], src: str | None = None, hook_dir: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m loom *loom_args` with `PRELUDE + hook` as sitecustomize and `env` added; `src`: a checkout's
    src/ folder to run instead of the installed loom."""
    with tempfile.TemporaryDirectory() as tmp:
        where = hook_dir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        (where / "sitecustomize.py").write_text(PRELUDE + hook)
        paths = [str(where)] + ([src] if src else []) + [os.environ.get("PYTHONPATH", "")]
        full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        return subprocess.run(
            [sys.executable, "-m", "loom", *loom_args], env=full, capture_output=True, text=True
        )


def rank_files(out: Path, nproc: int, r: subprocess.CompletedProcess) -> list[Path]:
    """The per-rank rank<N>.json files a hook wrote into `out`, in rank order; exits if a rank did not write."""
    files = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if len(files) != nproc:
        raise SystemExit(
            f"only {len(files)} of {nproc} ranks reported (exit {r.returncode}):\n"
            + r.stdout[-3000:]
            + r.stderr[-3000:]
        )
    return files
