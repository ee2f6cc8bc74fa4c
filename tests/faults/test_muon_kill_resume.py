"""Muon under FSDP (its momentum and AdamW moments sharded DTensors in DCP checkpoints): SIGKILL the job,
resume, and the replayed steps equal the killed attempt's bit for bit, then the run finishes. The reference
is the killed attempt itself: rank 1 hangs at step HANG (loom.faults), so the job has logged exactly steps
1..HANG-1 with its last checkpoint at CKPT_AT, and the resumed job replays CKPT_AT+1..HANG-1 from the
checkpoint alone (the second and later replayed steps depend on the restored momentum)."""

from __future__ import annotations

from faultkit import Proc, last_step, records, train_args, wait_for

STEPS, CKPT_AT, HANG = 10, 4, 8
MUON = [
    "--optim.name=muon",
    "--parallel.dp_impl=fsdp",
    "--nproc",
    "2",
    "--train.ckpt_every=4",
    "--train.keep_last=3",
]


def test_muon_fsdp_sigkill_then_resume_replays_bit_identical(char_data, tmp_path):
    run = tmp_path / "r"
    p = Proc(
        [*train_args(char_data, tmp_path, "r", STEPS), *MUON],
        tmp_path / "first",
        env={"LOOM_FAULT_HANG_STEP": str(HANG)},
    )
    wait_for(
        lambda: last_step(run) >= HANG - 1 and (run / "ckpt" / f"step_{CKPT_AT:06d}").is_dir(),
        p,
        what=f"step {HANG - 1}",
    )
    p.kill_all()
    first = {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    assert sorted(first) == list(range(1, HANG))
    r = Proc(["train", "--resume", str(run), "--nproc", "2"], tmp_path / "resume")
    assert r.wait() == 0, r.stderr()[-3000:]
    assert f"step_{CKPT_AT:06d}" in r.stdout()
    again = [rec for rec in records(run) if "loss" in rec][HANG - 1 :]  # what the resumed job logged
    assert [rec["step"] for rec in again] == list(range(CKPT_AT + 1, STEPS + 1))
    replayed = {rec["step"]: rec["loss"] for rec in again if rec["step"] < HANG}
    assert replayed == {s: first[s] for s in range(CKPT_AT + 1, HANG)}
