"""Data parallel on torch.distributed with real processes (gloo, loopback), compared with one process:
`loom verify` (DDP at 2 and 4 ranks, gradient-accumulation invariance), two torchrun "nodes", resume
across world sizes, and a killed rank ending the job."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loomrun import TINY, loom_run
from proctree import descendants, rank_of

from loom.env import free_port
from loom.metrics import read_jsonl

LOOM = [sys.executable, "-m", "loom"]


def loom(*args, timeout=240):
    return loom_run(*args, timeout=timeout)  # a warm fork, not a new interpreter (tests/loomrun.py)


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("nproc", [2, 4])
def test_verify_ddp_matches_one_process(tmp_path, char_data, nproc):
    out = tmp_path / "v"
    r = loom(
        "verify",
        "--strategies",
        "ddp",
        "--nproc",
        str(nproc),
        "--steps",
        "30",
        "--out",
        str(out),
        "--data",
        str(char_data),
        "--json",
        str(tmp_path / "v.json"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (rec,) = json.loads((tmp_path / "v.json").read_text())
    assert rec["strategy"] == "ddp" and rec["world_size"] == nproc and rec["passed"]
    # dp=nproc with 4/nproc accumulation steps equals dp=1 with 4 accumulation steps
    assert rec["grad_accum"] == 4 // nproc
    assert rec["max_abs_dloss"] <= 1e-6 and rec["max_abs_dparam"] <= 1e-5
    assert (out / "verify.png").stat().st_size > 1000
    assert len(losses(out / "ddp")) == 30


def test_two_torchrun_nodes_on_loopback(tmp_path, char_data):
    """Two single-process "nodes" rendezvous through c10d at 127.0.0.1 and train as dp=2."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    port = free_port()
    args = [f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=nodes", "--train.steps=6", *TINY]
    procs = []
    for _node in range(2):
        cmd = [
            torchrun,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "loomtest",
            "--no-python",
            *LOOM,
            "train",
            *args,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "world 2" in "".join(outs)
    assert len(losses(tmp_path / "nodes")) == 6
    run_json = json.loads((tmp_path / "nodes" / "run.json").read_text())
    assert run_json["world_size"] == 2


def test_resume_dp2_to_dp1_continues_the_curve(tmp_path, char_data):
    base = [
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        *TINY,
        "--train.steps=8",
        "--train.ckpt_every=4",
        "--train.keep_last=3",
    ]
    r = loom("train", "--nproc", "2", "--run.name=two", *base)
    assert r.returncode == 0, r.stderr
    straight = losses(tmp_path / "two")
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    r = loom("train", "--resume", str(tmp_path / "one" / "ckpt" / "step_000004"), "--train.device=cpu")
    assert r.returncode == 0, r.stderr
    assert "saved with world size 2" in r.stdout
    resumed = [
        rec for rec in read_jsonl(tmp_path / "one" / "metrics.jsonl", superseded=True) if "loss" in rec
    ][8:]
    assert [rec["step"] for rec in resumed] == [5, 6, 7, 8]
    for rec in resumed:
        assert abs(rec["loss"] - straight[rec["step"]]) < 1e-5


def test_killed_rank_ends_job_and_names_it(tmp_path, char_data):
    args = [
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=kill",
        *TINY,
        "--train.steps=100000",
        "--parallel.timeout_s=30",
    ]
    p = subprocess.Popen(
        [*LOOM, "train", "--nproc", "2", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "kill" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size > 200):
        time.sleep(0.2)
    victims = [c for c in descendants(p.pid) if rank_of(c) == 1]
    assert victims, "rank 1 not found"
    os.kill(victims[0], signal.SIGKILL)
    t0 = time.time()
    _, err = p.communicate(timeout=90)
    elapsed = time.time() - t0
    assert p.returncode != 0
    assert elapsed < 60
    assert "rank 1" in err and "SIGKILL" in err
    assert not [c for c in descendants(p.pid)]  # nothing left behind
