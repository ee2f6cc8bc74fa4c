"""DiLoCo and one process, with real runs: DiLoCo on one process is refused before any work (one replica has
nothing to average); a DiLoCo run (two processes, two replicas, H = 4) resumed without its --nproc is told why
and how, and resumed with another H is refused; continued as plain training (H = 0, dp_replicate = 1) on one
process it starts from the checkpoint's step with replica 0's weights. Compared against: the run's own
checkpoint (the resumed run's first step follows it) and the exit codes and messages a user reads."""

from __future__ import annotations

import pytest
from loomrun import loom_run
from tiny import tiny_args

from loom.metrics import read_jsonl

H = 4
DILOCO = ["--parallel.dp_impl=ddp", "--parallel.dp_replicate=2", f"--parallel.diloco_inner_steps={H}"]


def _args(data, runs, name: str, steps: int) -> list[str]:
    return [f"--data.path={data}", f"--run.dir={runs}", f"--run.name={name}", f"--train.steps={steps}"]


def test_diloco_on_one_process_is_refused_before_any_work(char_data, tmp_path):
    r = loom_run(
        "train", *_args(char_data, tmp_path, "one", 8), *tiny_args(), "--parallel.diloco_inner_steps=4"
    )
    assert r.returncode == 2, r.stderr
    assert "on one process: DiLoCo averages what its replicas learned" in r.stderr
    assert not (tmp_path / "one" / "ckpt").exists()


@pytest.fixture(scope="module")
def diloco_run(char_data, tmp_path_factory):
    runs = tmp_path_factory.mktemp("diloco")
    flags = [
        *_args(char_data, runs, "dl", 2 * H),
        *tiny_args(),
        "--nproc=2",
        *DILOCO,
        f"--train.ckpt_every={H}",
    ]
    r = loom_run("train", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr  # the run's header names loom --nproc as its launcher, not torchrun
    assert "launcher loom --nproc" in out and "torchrun" not in out
    return runs / "dl"


def test_a_diloco_run_resumed_on_one_process_is_told_why(diloco_run):
    r = loom_run("train", "--resume", str(diloco_run), f"--train.steps={3 * H}")
    assert r.returncode == 2, r.stderr
    assert "one process is a single replica with nothing to average" in r.stderr
    assert "parallel.dp_replicate=2 needs at least 2 processes" in r.stderr
    assert "--nproc 2" in r.stderr and "--parallel.diloco_inner_steps=0" in r.stderr
    r = loom_run(
        "train",
        "--resume",
        str(diloco_run),
        f"--train.steps={3 * H}",
        "--nproc=2",
        "--parallel.diloco_inner_steps=2",
    )
    assert r.returncode == 2, r.stderr
    assert "was trained with parallel.diloco_inner_steps=4, not 2" in r.stderr


def test_a_diloco_run_continues_as_plain_training_on_one_process(diloco_run):
    flags = ["--parallel.diloco_inner_steps=0", "--parallel.dp_replicate=1", "--parallel.dp_impl=none"]
    r = loom_run("train", "--resume", str(diloco_run), f"--train.steps={3 * H}", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [rec["step"] for rec in read_jsonl(diloco_run / "metrics.jsonl") if "loss" in rec]
    assert steps == list(range(1, 3 * H + 1))  # 1-8 under DiLoCo, 9-12 plain, from the step-8 checkpoint
    assert (
        "outer_step"
        not in [rec for rec in read_jsonl(diloco_run / "metrics.jsonl") if rec.get("step") == 3 * H][-1]
    )
