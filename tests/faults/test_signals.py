"""SIGTERM (preemption): loom finishes the current step, saves a checkpoint there and exits with
EXIT_PREEMPTED (75); resuming continues the uninterrupted curve bit for bit (conftest's references). With
two ranks the signal may reach only the launcher (which forwards it) or only one worker: every rank stops
after the same step, which the single checkpoint and the last logged step show (resuming from such a
checkpoint is the same path as test_kill_resume's two-process case)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from faultkit import CKPT, STEPS, Proc, alive, curve, last_step, rank_of, run_inprocess, train_args, wait_for

from loom import checkpoint
from loom.errors import EXIT_PREEMPTED

SEED = int(os.environ.get("LOOM_FAULT_SEED", str(time.time_ns() % 100_000)))


def _stop_and_check(p: Proc, run, k: int, target: str) -> int:
    wait_for(lambda: last_step(run) >= k, p, what=f"step {k}")
    tree = p.tree()
    pid = next(c for c in tree if rank_of(c) == 1) if target == "rank 1" else p.pid
    os.kill(pid, signal.SIGTERM)
    t0 = time.monotonic()
    rc = p.wait(timeout=60)
    took = time.monotonic() - t0
    assert rc == EXIT_PREEMPTED, p.stderr()[-3000:]
    stopped = last_step(run)
    assert stopped < STEPS
    assert checkpoint.latest_valid(run / "ckpt") == run / "ckpt" / f"step_{stopped:06d}"
    assert f"stopping at step {stopped} (" in p.stdout()
    assert not alive(tree)
    print(
        f"\n[fault] SIGTERM to {target} at step {k}: checkpoint at step {stopped}, exit {rc} {took:.1f}s later"
    )
    return stopped


def test_sigterm_saves_and_exits_with_the_preempted_code(char_data, tmp_path, ref_one):
    k = random.Random(SEED).randint(8, STEPS - 10)
    run = tmp_path / "r"
    p = Proc(train_args(char_data, tmp_path, "r", STEPS, *CKPT), tmp_path / "out")
    stopped = _stop_and_check(p, run, k, "the process")
    assert "SIGTERM received: stopping after this step" in p.stderr()
    assert run_inprocess(["train", "--resume", str(run)]) == 0
    assert curve(run) == ref_one  # nothing lost, nothing changed
    assert stopped == min(s for s in curve(run) if s >= stopped)


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_two_ranks_stop_after_the_same_step(char_data, tmp_path, ref_two, target):
    """With the signal at rank 1 only, rank 0 (which got none) stops and saves at rank 1's step."""
    k = random.Random(SEED + 1).randint(8, STEPS - 10)
    run = tmp_path / "r"
    p = Proc([*train_args(char_data, tmp_path, "r", STEPS, *CKPT), "--nproc", "2"], tmp_path / "out")
    stopped = _stop_and_check(p, run, k, target)
    assert all(curve(run)[s] == ref_two[s] for s in range(1, stopped + 1))
