"""kill -9 of a `loom rl --rl.max_staleness=1` run, then --resume, against an uninterrupted run of the same command
(CPU, fp32, one thread in every process: faultkit.ENV). What the resume replays (loom.rl.async_rollout's
docstring): nothing of the rollout worker is saved; the steps up to the checkpoint are the uninterrupted run's
bit for bit (the schedule is fixed: rollout r is sampled with the weights of step r - 1), and after it the rollout
the interrupted run had sampled with the weights one step older is sampled again with the checkpoint's own, so
the first resumed step's staleness is 0 (the uninterrupted run's: 1), and the run goes on to its last step.

Only the trainer killed (the worker is its child, not killed): the worker sees its parent gone and exits."""

from __future__ import annotations

import os
import signal
import time

from faultkit import Proc, alive, records, run_inprocess, wait_for
from rlkit import rl_args

from loom import checkpoint

FLAT = [
    "--rl.reward=regex",
    "--rl.pattern=1",
    "--train.steps=8",
    "--train.ckpt_every=3",
    "--rl.max_staleness=1",
]


def _by_step(run) -> dict[int, dict]:
    """step -> its record (a step logged twice, replayed after the resume, keeps its last)."""
    return {r["step"]: r for r in records(run) if "loss" in r and "step" in r}


def _worker_of(p: Proc) -> int:
    """The rollout worker's pid: the trainer's child running multiprocessing's spawn."""
    for pid in p.tree()[1:]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"multiprocessing" in f.read():
                return pid
    raise AssertionError("no rollout worker under the trainer")


def test_kill_9_during_async_rl_then_resume_replays_from_the_checkpoints_weights(rl_root, tmp_path):
    runs = rl_root / "runs"
    assert run_inprocess(rl_args(rl_root, "a-whole", *FLAT)) == 0
    p = Proc(rl_args(rl_root, "a-cut", *FLAT), tmp_path / "cut")
    wait_for(
        lambda: (
            checkpoint.latest_valid(runs / "a-cut" / "ckpt") is not None
            and max(_by_step(runs / "a-cut"), default=0) >= 4
        ),
        p,
        what="step 4 after a checkpoint",
    )
    worker = _worker_of(p)
    os.kill(p.pid, signal.SIGKILL)  # the trainer alone
    p.p.wait(30)
    deadline = time.monotonic() + 15
    while alive([worker]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive([worker]), "the rollout worker outlived its trainer"
    saved = checkpoint.latest_valid(runs / "a-cut" / "ckpt")
    s = int(saved.name.split("_")[1])
    assert s in (3, 6)
    assert run_inprocess([*rl_args(rl_root, "a-cut", *FLAT), "--resume"]) == 0
    whole, cut = _by_step(runs / "a-whole"), _by_step(runs / "a-cut")
    assert sorted(cut) == list(range(1, 9))
    keys = ("loss", "grad_norm", "rl/reward_mean", "rl/staleness")
    assert [[whole[i][k] for k in keys] for i in range(1, s + 1)] == [
        [cut[i][k] for k in keys] for i in range(1, s + 1)
    ]
    assert whole[s + 1]["rl/staleness"] == 1 and cut[s + 1]["rl/staleness"] == 0
    assert all(cut[i]["rl/staleness"] == 1 for i in range(s + 2, 9))
