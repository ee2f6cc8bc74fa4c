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


def _held(run) -> list:
    return list((run / "ckpt").glob("step_*.tmp/HELD"))


def _stop_while_held(tmp_path, char_data, sig=signal.SIGINT) -> tuple[Proc, object]:
    """A run with no periodic checkpoint whose saves wait (LOOM_FAULT_HOLD_SAVE) until the test lets them go
    on: stopped by `sig` after step 3, it is left in the middle of writing its stop checkpoint."""
    run = tmp_path / "r"
    p = Proc(
        train_args(char_data, tmp_path, "r", STEPS, "--train.ckpt_every=0"),
        tmp_path / "out",
        env={"LOOM_FAULT_HOLD_SAVE": "1"},
    )
    wait_for(lambda: last_step(run) >= 3, p, what="step 3")
    os.kill(p.pid, sig)
    wait_for(lambda: _held(run), p, what="the stop checkpoint's write")
    return p, run


def test_second_ctrl_c_while_the_stop_checkpoint_is_written_finishes_it(char_data, tmp_path, ref_one):
    """Issue 27 item 7: a second Ctrl-C during the stop checkpoint abandoned it half written. Now it is
    finished (the user is told so), the exit is EXIT_PREEMPTED and --resume continues the same curve."""
    p, run = _stop_while_held(tmp_path, char_data)
    for n in (1, 2):  # one at a time: signals that arrive together are delivered once
        os.kill(p.pid, signal.SIGINT)
        wait_for(
            lambda n=n: p.stderr().count("is being written: finishing it first") == n, p, what="the notice"
        )
    _held(run)[0].unlink()  # the write goes on
    assert p.wait(timeout=60) == EXIT_PREEMPTED, p.stderr()[-3000:]
    stopped = last_step(run)
    assert checkpoint.latest_valid(run / "ckpt") == run / "ckpt" / f"step_{stopped:06d}"
    assert f"SIGINT received while the stop checkpoint of step {stopped} is being written" in p.stderr()
    assert run_inprocess(["train", "--resume", str(run)]) == 0
    assert curve(run) == ref_one


def test_stop_checkpoint_killed_half_way_is_discarded_and_the_run_can_start(
    char_data, tmp_path, ref_one, capsys
):
    """Issue 27 item 7: killed while its only checkpoint was being written, a run refused --resume ("start
    without --resume"), a plain start ("pass --resume") and train.resume=auto ("pass --resume"): only --force
    got out. Now the partial save is named as discarded, the hints agree, and train.resume=auto starts the run
    again (it has nothing to resume), giving the uninterrupted curve."""
    p, run = _stop_while_held(tmp_path, char_data, signal.SIGTERM)
    p.kill_all()
    partial = [x.name for x in (run / "ckpt").iterdir()]
    assert len(partial) == 1 and partial[0].endswith(".tmp")
    args = train_args(char_data, tmp_path, "r", STEPS, "--train.ckpt_every=0")
    capsys.readouterr()
    assert run_inprocess([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"no valid checkpoint under '{run / 'ckpt'}' ({partial[0]}: a save interrupted half way" in err
    assert "nothing to resume" in err and "--force" in err and "train.resume=auto" in err
    assert run_inprocess(args) == 2
    err = capsys.readouterr().err
    assert "already holds a run with no complete checkpoint" in err and "--resume" not in err
    assert run_inprocess([*args, "--train.resume=auto"]) == 0
    assert "has no valid checkpoint: starting it again" in capsys.readouterr().out
    assert curve(run) == ref_one
    assert [x.name for x in (run / "ckpt").iterdir()] == [f"step_{STEPS:06d}"]


def test_stop_checkpoint_that_cannot_be_written_fails_the_run(char_data, tmp_path):
    """Issue 27 item 1: on a signal the stop checkpoint is the run's last save; when it cannot be written
    (tried twice) the exit is an error naming what is not saved, not EXIT_PREEMPTED and "run with --resume"."""
    run = tmp_path / "r"
    p = Proc(
        train_args(char_data, tmp_path, "r", STEPS, "--train.ckpt_every=0"),
        tmp_path / "out",
        env={"LOOM_FAULT_FREE_BYTES": "4096"},
    )
    wait_for(lambda: last_step(run) >= 3, p, what="step 3")
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=60) == 2, p.stderr()[-3000:]
    stopped = last_step(run)
    assert (
        f"the stop checkpoint of step {stopped} could not be saved (tried twice: not enough disk space"
        in p.stderr()
    )
    assert f"steps 1-{stopped} of this run are in no checkpoint" in p.stderr()
    assert "run the same command with --resume" not in p.stdout()
