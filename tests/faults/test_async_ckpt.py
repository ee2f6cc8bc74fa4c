"""Background checkpoints (train.async_ckpt=true, here on CPU): a SIGKILL while a background save is being
written leaves the previous checkpoint as the newest valid one and the resumed curve equals the uninterrupted
run (conftest's references) bit for bit; a SIGTERM waits for the save in flight, saves the current step and
exits 75; two ranks write their shards from writer threads on a gloo group of their own; a disk that fills
during a background write never leaves that step looking complete, and the run goes on or stops as
train.on_save_error says."""

from __future__ import annotations

import os
import signal

import pytest
from faultkit import CKPT, STEPS, Proc, curve, last_step, run_inprocess, train_args, wait_for

from loom import checkpoint
from loom.errors import EXIT_PREEMPTED
from loom.metrics import read_jsonl

ASYNC = "--train.async_ckpt=true"


def test_sigkill_during_a_background_save_resumes_bit_exact(char_data, tmp_path, ref_one):
    run = tmp_path / "r"
    p = Proc(
        train_args(char_data, tmp_path, "r", STEPS, *CKPT, ASYNC),
        tmp_path / "out",
        env={"LOOM_FAULT_STALL_SAVE": "12"},
    )
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


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_disk_filling_during_a_background_save(char_data, tmp_path, monkeypatch, capsys, policy):
    monkeypatch.setenv("LOOM_FAULT_DISK_FULL", "4")  # ENOSPC after the first file of step 4's write
    args = train_args(
        char_data,
        tmp_path,
        "r",
        8,
        "--train.ckpt_every=2",
        "--train.keep_last=5",
        f"--train.on_save_error={policy}",
        ASYNC,
    )
    rc = run_inprocess(args)
    out = capsys.readouterr()
    ckpt = tmp_path / "r" / "ckpt"
    assert not (ckpt / "step_000004").exists() and not (ckpt / "step_000004.tmp").exists()
    assert "No space left on device" in out.out + out.err
    if policy == "continue":  # the failure is learned when the next save waits; the run goes on
        assert rc == 0 and last_step(tmp_path / "r") == 8
        assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002", "step_000006", "step_000008"]
        errors = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "ckpt_error" in r]
        assert [r["step"] for r in errors] == [4]
    else:  # stops at that wait (step 6), before any later checkpoint
        assert rc == 2 and last_step(tmp_path / "r") == 6
        assert sorted(p.name for p in ckpt.iterdir()) == ["step_000002"]


def test_a_save_that_outruns_its_writer_waits_says_so_and_records_it(
    char_data, tmp_path, monkeypatch, capsys
):
    # A writer slower than the save interval (here 0.5 s per save against millisecond steps): the next save
    # waits for it, warns, and metrics.jsonl records the wait within the blocked time of every save.
    import time

    real = checkpoint.save_sharded

    def slow(*a, **k):
        time.sleep(0.5)
        return real(*a, **k)

    monkeypatch.setattr(checkpoint, "save_sharded", slow)
    assert run_inprocess(train_args(char_data, tmp_path, "r", 6, "--train.ckpt_every=2", ASYNC)) == 0
    out = capsys.readouterr()
    assert "the background save of the previous checkpoint was still writing" in out.out + out.err
    saves = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "ckpt_blocked_s" in r]
    assert [r["step"] for r in saves] == [2, 4, 6]
    assert saves[0]["ckpt_waited_s"] == 0 and saves[1]["ckpt_waited_s"] > 0.3
    assert all(r["ckpt_blocked_s"] >= r["ckpt_waited_s"] for r in saves)
    assert saves[2]["ckpt_blocked_s"] > 0.5  # the last save is written before the run ends
    assert checkpoint.latest_valid(tmp_path / "r" / "ckpt") == tmp_path / "r" / "ckpt" / "step_000006"
