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


def loom_run(
    *args: str, env: dict | None = None, cwd: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`loom ARGS` as a command of its own (exit code, stdout, stderr; `env`: its whole environment, default
    this one's; `cwd`: its folder, default this one's), what `subprocess.run([*LOOM, *args], capture_output=True, text=True)` gives, but started as a
    fork of loom's preloaded fork server (loom.train.spawn.start_loom): ~4 s of CPU fewer a command."""
    import contextlib
    import os
    import signal
    import tempfile

    from loom.train.spawn import start_loom

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        env = dict(os.environ if env is None else env)
        p = start_loom(
            list(map(str, args)),
            env,
            cwd=cwd and str(cwd),
            out=out.fileno(),
            err=err.fileno(),
            session=True,
            server=True,
        )
        p.join(timeout)
        if p.exitcode is None:  # past its time: it and whatever it started
            with contextlib.suppress(ProcessLookupError):  # no session yet: it had not begun
                os.killpg(p.pid, signal.SIGKILL)
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired([*LOOM, *args], timeout)
        text = [f.seek(0) or f.read().decode("utf-8", "replace") for f in (out, err)]
    return subprocess.CompletedProcess([*LOOM, *args], p.exitcode, *text)


def loom_ok(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`loom ARGS` as a command of its own (loom_run), which must exit 0 (the end of its output is the failure
    message)."""
    r = loom_run(*args, timeout=timeout)
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
