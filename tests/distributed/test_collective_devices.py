"""Device-correct collectives: every collective a training job issues goes to a backend that serves its
tensor's device, checked on the backend map a GPU job would have (hooks/sitecustomize.py explains how).

The bug this guards against: a GPU job's group used to be NCCL-only, while the control plane (config
agreement, stop and non-finite flags, the checkpoint outcome) all-reduced CPU tensors, which NCCL cannot take:
every multi-GPU job failed before its first step, and no CPU test could see it. Compared against: the device
types each backend serves (NCCL: cuda; gloo: cpu and cuda)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import tiny_args

HOOKS = Path(__file__).parent / "hooks"
TINY = tiny_args({"optim.warmup_steps": 1, "train.eval_every": None})


def checked_run(tmp_path, data, impl: str, backend_override: str | None = None) -> list[dict]:
    """`loom train --nproc 2` with every collective checked; what each rank saw."""
    out = tmp_path / "seen"
    out.mkdir()
    env = {
        **os.environ,
        "LOOM_CHECK_DEVICES_AS": "cuda",
        "LOOM_CHECK_OUT": str(out),
        "PYTHONPATH": os.pathsep.join(p for p in (str(HOOKS), os.environ.get("PYTHONPATH", "")) if p),
    }
    if backend_override:
        env["LOOM_CHECK_BACKEND"] = backend_override
    # 3 steps with an eval and a checkpoint: config agreement, the run plan, stop/skip flags, the checkpoint
    # outcome, gradient and loss collectives, the validation sums
    args = [
        f"--data.path={data}",
        f"--run.dir={tmp_path}",
        "--train.steps=3",
        "--train.eval_every=2",
        "--train.ckpt_every=2",
        f"--parallel.dp_impl={impl}",
        *TINY,
    ]
    # a new interpreter, not loomrun.loom_run's warm fork: the hook is a sitecustomize, which only starts run
    r = subprocess.run(
        [sys.executable, "-m", "loom", "train", "--nproc=2", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert len(seen) == 2, "every rank reports what it saw"
    return seen


@pytest.mark.parametrize("impl", ["ddp", "fsdp"])
def test_every_collective_fits_its_backend_on_a_gpu_job(tmp_path, char_data, impl):
    for rank in checked_run(tmp_path, char_data, impl):
        assert rank["cpu_tensors"] > 0, "the control plane's CPU values went through the checked API"
        assert not rank["violations"], "\n".join(rank["violations"][:3])


def test_the_check_fails_on_an_nccl_only_group(tmp_path, char_data):
    """The check is not vacuous: with the NCCL-only group loom used to create on GPUs, the same job's
    control-plane collectives (CPU tensors) are flagged."""
    seen = checked_run(tmp_path, char_data, "ddp", backend_override="nccl")
    for rank in seen:
        assert rank["violations"], "a CPU tensor on an NCCL-only group must be flagged"
        assert any("cpu tensor" in v for v in rank["violations"])
