"""`loom launch` of torchft jobs run for real on this machine (loom.launch.ft; the commands themselves:
tests/unit/test_launch_ft.py): one node, where it is `loom train --nproc` (loom's own ft launcher), both
groups training every step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import tiny_args

from loom.metrics import read_jsonl

pytest.importorskip("torchft", reason="the ft extra (pip install loom[ft])")


def _train(data: Path, runs: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "loom",
        "train",
        f"--data.path={data}",
        f"--run.dir={runs}",
        "--run.name=job",
        f"--train.steps={steps}",
        *tiny_args({"model.block_size": 16, "model.dropout": 0}),
        "--ft.enabled=true",
        "--ft.min_replicas=2",  # the first quorum waits for both groups (the lighthouse's minimum too)
    ]


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # torchrun and torchft_lighthouse
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_one_local_node_runs_loom_train_nproc(char_data, tmp_path):
    argv = [
        sys.executable,
        "-m",
        "loom",
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        *_train(char_data, tmp_path, 6),
    ]
    r = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert _steps(tmp_path / "job") == list(range(1, 7)) == _steps(tmp_path / "job-g1")
