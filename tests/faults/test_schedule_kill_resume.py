"""train.batch_schedule and train.seq_schedule together: SIGKILL a run inside the ramp, resume it, and every
replayed step equals the killed attempt's bit for bit (loss, and the batch and length it records), across a change
of batch size and of length. The reference is the killed attempt itself: the run hangs at step HANG
(loom.faults), so it has logged exactly steps 1..HANG-1, with checkpoints at 3 and 6. Resumed from step 6 it
replays 7 and goes on through the length change at step 8; resumed from step 3 (a copy of the folder) it replays
4-7 across the batch change at 6 and the length change at 5, and its steps 8-10 equal the other resume's. Dropout
is on: the RNG state comes back too."""

from __future__ import annotations

import shutil

from faultkit import Proc, last_step, records, train_args, wait_for

STEPS, HANG = 10, 8
# block_size 16, batch 8 (faultkit's TINY): micro-batches of 2 sequences, so 1, 2 then 4 of them a step
SCHEDULES = ["--train.batch_schedule=2@0,4@2,8@5", "--train.seq_schedule=4@0,8@4,16@7"]
CKPT = ["--train.ckpt_every=3", "--train.keep_last=5"]


def _steps(run, start: int) -> list[dict]:
    return [r for r in records(run) if "loss" in r][start:]


def test_kill_inside_the_ramp_then_resume_replays_bit_identical(char_data, tmp_path):
    run = tmp_path / "r"
    p = Proc(
        [*train_args(char_data, tmp_path, "r", STEPS), *SCHEDULES, *CKPT],
        tmp_path / "first",
        env={"LOOM_FAULT_HANG_STEP": str(HANG), "LOOM_FAULT_HANG_RANK": "0"},
    )
    wait_for(
        lambda: last_step(run) >= HANG - 1 and (run / "ckpt" / "step_000006").is_dir(),
        p,
        what=f"step {HANG - 1}",
    )
    p.kill_all()
    first = {r["step"]: r for r in _steps(run, 0)}
    assert sorted(first) == list(range(1, HANG))
    assert [(first[s]["batch_size"], first[s]["seq_len"]) for s in (1, 3, 5, 6, 7)] == [
        (2, 4),
        (4, 4),
        (4, 8),
        (8, 8),
        (8, 8),
    ]
    early = tmp_path / "early"
    shutil.copytree(run, early)
    shutil.rmtree(early / "ckpt" / "step_000006")

    for folder, ckpt in ((run, 6), (early, 3)):
        r = Proc(["train", "--resume", str(folder)], tmp_path / f"resume{ckpt}")
        assert r.wait() == 0, r.stderr()[-3000:]
        assert f"step_{ckpt:06d}" in r.stdout()
        again = _steps(folder, HANG - 1)  # what the resumed run logged
        assert [rec["step"] for rec in again] == list(range(ckpt + 1, STEPS + 1))
        for rec in again:
            if rec["step"] < HANG:  # replayed: the killed attempt's step, bit for bit
                want = first[rec["step"]]
                assert (rec["loss"], rec["grad_norm"], rec["tokens"]) == (
                    want["loss"],
                    want["grad_norm"],
                    want["tokens"],
                )
        assert (again[-1]["batch_size"], again[-1]["seq_len"], again[-1]["tokens"]) == (8, 16, 896)
    late = {rec["step"]: rec["loss"] for rec in _steps(run, HANG - 1)}
    assert {rec["step"]: rec["loss"] for rec in _steps(early, HANG - 1) if rec["step"] >= HANG} == {
        s: late[s] for s in range(HANG, STEPS + 1)
    }
