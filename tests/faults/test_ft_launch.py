"""`loom launch` of torchft jobs run for real on this machine (loom.launch.ft; the commands themselves:
tests/unit/test_launch_ft.py): one node (`loom train --nproc`, loom's own ft launcher), and two `loom launch`
"nodes" (`--node-rank 0/1` against 127.0.0.1), node 0 serving the lighthouse, each node's torchrun one replica
group, both training every step in one quorum."""

from __future__ import annotations

import ipaddress
import os
import socket
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


def _own_address() -> str | None:
    """This machine's address on its default route (no packet is sent), if it has one that is not loopback:
    loom launch's gate refuses a loopback head address for several nodes."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.254.254.254", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(ip).is_loopback else ip


def test_two_local_nodes_train_as_two_replica_groups(char_data, tmp_path):
    """`loom launch --nnodes 2 --node-rank I --master-addr HEAD` twice on this machine (HEAD: its own address):
    node 0 serves the lighthouse bound to HEAD, each node's torchrun is one replica group; both finish every
    step, in one quorum."""
    head = _own_address()
    if head is None:
        pytest.skip("this machine has no non-loopback address for a 2-node gate")
    port = 29000 + os.getpid() % 2000
    base = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", head, "--port", str(port)]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loom",
                "launch",
                *base,
                "--node-rank",
                str(i),
                "--",
                *_train(char_data, tmp_path, 20),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=180)[0] for p in nodes]
    finally:  # a node left waiting for the other (the gate, the quorum) is not left running
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert _steps(tmp_path / "job") == list(range(1, 21)) == _steps(tmp_path / "job-g1")
    quorum = [r["ft"] for r in read_jsonl(tmp_path / "job" / "metrics.jsonl") if "ft" in r]
    assert quorum[-1]["replicas"] == [0, 1]
    assert f"--bind {head}:{port + 1}" in outs[0]


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
