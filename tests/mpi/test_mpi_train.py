"""`loom train` under mpiexec with parallel.dp_impl=mpi (no torch.distributed), compared with one process
and with DDP by `loom verify`; naive and bucketed synchronisers must give identical parameters."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from loom import checkpoint


def test_verify_mpi_strategies_match_one_process_and_each_other(tmp_path, char_data):
    out = tmp_path / "v"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "loom",
            "verify",
            "--strategies",
            "mpi-naive,mpi-bucketed,ddp",
            "--nproc",
            "2",
            "--steps",
            "30",
            "--out",
            str(out),
            "--data",
            str(char_data),
            "--json",
            str(tmp_path / "v.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    recs = {rec["strategy"]: rec for rec in json.loads((tmp_path / "v.json").read_text())}
    assert set(recs) == {"mpi-naive", "mpi-bucketed", "ddp"}
    for rec in recs.values():
        assert rec["passed"] and rec["max_abs_dloss"] <= 1e-6, rec
    naive = checkpoint.load(checkpoint.latest_valid(out / "mpi-naive" / "ckpt"))[0]["model"]
    bucketed = checkpoint.load(checkpoint.latest_valid(out / "mpi-bucketed" / "ckpt"))[0]["model"]
    for k in naive:
        assert torch.equal(naive[k], bucketed[k]), k


def test_mpi_without_mpiexec_trains_alone(tmp_path, char_data):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "loom",
            "train",
            f"--data.path={char_data}",
            f"--run.dir={tmp_path}",
            "--run.name=solo",
            "--parallel.dp_impl=mpi",
            "--train.steps=3",
            "--model.n_layer=1",
            "--model.n_embd=32",
            "--model.n_head=2",
            "--model.block_size=16",
            "--train.sample_every=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "not started by mpiexec" in r.stdout + r.stderr
    assert (tmp_path / "solo" / "ckpt" / "step_000003").is_dir()


def test_bad_bucket_size_is_refused(tmp_path, char_data):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "loom",
            "train",
            f"--data.path={char_data}",
            f"--run.dir={tmp_path}",
            "--parallel.dp_impl=mpi",
            "--parallel.bucket_mb=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "bucket_mb must be > 0" in r.stderr
    assert not any(tmp_path.iterdir())  # nothing written


def test_mixture_of_experts_under_mpi_matches_one_process(tmp_path, char_data):
    """The MoE family under parallel.dp_impl=mpi (expert parallelism off: every rank holds every expert): the
    expert gradients are averaged with the rest, and the balance bias moves by the load summed over the ranks
    through the synchroniser's all-reduce, as one process moves it."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "loom",
            "verify",
            "--strategies",
            "mpi-bucketed",
            "--nproc",
            "2",
            "--steps",
            "10",
            "--out",
            str(tmp_path / "v"),
            "--data",
            str(char_data),
            "--json",
            str(tmp_path / "v.json"),
            "--model.family=moe",
            "--model.n_experts=4",
            "--model.moe_bias_update_rate=0.01",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (rec,) = json.loads((tmp_path / "v.json").read_text())
    assert rec["passed"] and rec["max_abs_dloss"] <= 1e-5 and rec["max_abs_dparam"] <= 1e-5, rec
    model = checkpoint.load(checkpoint.latest_valid(tmp_path / "v" / "mpi-bucketed" / "ckpt"))[0]["model"]
    assert any(k.endswith("expert_bias") and v.abs().sum() > 0 for k, v in model.items())  # it moved
