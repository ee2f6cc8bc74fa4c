"""Background checkpoints (train.async_ckpt=true, here on CPU): a SIGKILL while a background save is being
written leaves the previous checkpoint as the newest valid one and the resumed curve equals the uninterrupted
run (conftest's references) bit for bit; a SIGTERM waits for the save in flight, saves the current step and
exits 75; two ranks write their shards from writer threads on a gloo group of their own."""

from __future__ import annotations

import os
import signal

from faultkit import CKPT, STEPS, Proc, curve, last_step, run_inprocess, train_args, wait_for

from loom import checkpoint
from loom.errors import EXIT_PREEMPTED

ASYNC = "--train.async_ckpt=true"


def test_sigkill_during_a_background_save_resumes_bit_exact(char_data, tmp_path, ref_one):
    run = tmp_path / "r"
    p = Proc(train_args(char_data, tmp_path, "r", STEPS, *CKPT, ASYNC), tmp_path / "out",
             env={"LOOM_FAULT_STALL_SAVE": "12"})  # fmt: skip
    wait_for((run / "ckpt" / "step_000012.tmp" / "STALLED").exists, p, what="the stalled background write")
    wait_for(lambda: last_step(run) >= 13, p, what="a step while the save is in flight")  # the loop went on
    p.kill_all()
    assert checkpoint.latest_valid(run / "ckpt") == run / "ckpt" / "step_000006"
    assert not (run / "ckpt" / "step_000012").exists()
    assert run_inprocess(["train", "--resume", str(run), ASYNC]) == 0
    assert curve(run) == ref_one


def test_sigterm_waits_for_the_background_save(char_data, tmp_path, ref_one):
    run = tmp_path / "r"
    p = Proc(train_args(char_data, tmp_path, "r", STEPS, *CKPT, ASYNC), tmp_path / "out")
    wait_for(lambda: last_step(run) >= 8, p, what="step 8")  # a background save of step 6 has started
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=60) == EXIT_PREEMPTED, p.stderr()[-3000:]
    stopped = last_step(run)
    assert checkpoint.latest_valid(run / "ckpt") == run / "ckpt" / f"step_{stopped:06d}"
    assert (run / "ckpt" / "step_000006" / "manifest.json").exists()  # the in-flight save was completed
    assert run_inprocess(["train", "--resume", str(run)]) == 0
    assert curve(run) == ref_one


def test_two_ranks_save_in_the_background(char_data, tmp_path, ref_two):
    run = tmp_path / "r"
    p = Proc([*train_args(char_data, tmp_path, "r", STEPS, *CKPT, ASYNC), "--nproc", "2"], tmp_path / "out")
    assert p.wait() == 0, p.stderr()[-3000:]
    step = run / "ckpt" / "step_000012"
    checkpoint.verify(step)
    assert sorted(x.name for x in (step / "model").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert curve(run) == ref_two  # the writer threads change nothing in training
