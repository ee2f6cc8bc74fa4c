"""What the tests that start `loom` as a command share (a module beside conftest.py, on the tests' path): the
command, the tiny CPU model most of them train, running it with the exit code checked, and a run's losses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loom.metrics import read_jsonl

LOOM = [sys.executable, "-m", "loom"]
TINY = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--model.block_size=32",
    "--train.batch_size=8",
    "--train.eval_batches=2",
    "--train.sample_every=0",
    "--optim.warmup_steps=3",
    "--train.log_every=1",
    "--train.eval_every=0",
    "--train.device=cpu",
]


def loom_ok(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`loom ARGS` in a subprocess, which must exit 0 (the end of its output is the failure message)."""
    r = subprocess.run([*LOOM, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def run_losses(run: Path, start: int = 0) -> list[tuple[int, float]]:
    """(step, loss) of every record a run wrote (those a resume superseded too), from the start-th on."""
    recs = read_jsonl(Path(run) / "metrics.jsonl", superseded=True)
    return [(r["step"], r["loss"]) for r in recs if "loss" in r][start:]
