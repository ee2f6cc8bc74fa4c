"""What the tests that start `loom` as a command share (a module beside conftest.py, on the tests' path): the
command, the tiny CPU model most of them train (tests/tiny.py), running it with the exit code checked,
and a run's losses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiny import TINY  # noqa: F401 (the tests import it from here too)

from loom.metrics import read_jsonl

LOOM = [sys.executable, "-m", "loom"]


def loom_ok(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`loom ARGS` in a subprocess, which must exit 0 (the end of its output is the failure message)."""
    r = subprocess.run([*LOOM, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def run_losses(run: Path, start: int = 0) -> list[tuple[int, float]]:
    """(step, loss) of every record a run wrote (those a resume superseded too), from the start-th on."""
    recs = read_jsonl(Path(run) / "metrics.jsonl", superseded=True)
    return [(r["step"], r["loss"]) for r in recs if "loss" in r][start:]


def verify_records(tmp_path: Path, data: Path, strategies: str, *flags: str, steps: int = 6) -> list[dict]:
    """`loom verify --strategies STRATEGIES` against one process (exit 0), its records in strategy order, each
    checked to have passed within 1e-5 of one process's loss and parameters (fp32)."""
    import json

    loom_ok(
        "verify",
        "--strategies",
        strategies,
        "--steps",
        str(steps),
        "--out",
        str(tmp_path / "v"),
        "--data",
        str(data),
        "--json",
        str(tmp_path / "v.json"),
        *flags,
        timeout=600,
    )
    recs = json.loads((tmp_path / "v.json").read_text())
    assert [r["strategy"] for r in recs] == strategies.split(",")
    for r in recs:
        assert r["passed"] and r["max_abs_dloss"] <= 1e-5 and r["max_abs_dparam"] <= 1e-5, r
    return recs


def loom_here(*args: str) -> None:
    """`loom ARGS` in this process, which must return 0: no interpreter and torch import of its own (~3.4 s of
    CPU); `train --nproc N` starts its N workers from here. One thread, like the subprocesses (same
    floating-point order)."""
    import torch

    from loom.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(list(args)) == 0, args
    finally:
        torch.set_num_threads(threads)
