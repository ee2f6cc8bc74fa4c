"""PowerSGD across a resume: its state (iteration, each rank's error feedback, the warm-started P and Q, the
random state) is checkpointed, so a run resumed after its warm-up goes on compressing exactly. Compared against
the same run uninterrupted: two processes, DDP, PowerSGD rank 2 after 2 warm-up steps, a checkpoint at step 4;
`--resume` from step 4 replays steps 5-8, whose losses and bytes must equal the first run's bit for bit
(without the state the resumed run warms up again: plain all-reduces, other numbers)."""

from __future__ import annotations

from faultkit import records, run_inprocess, train_args

STEPS = 8
FLAGS = [
    "--nproc",
    "2",
    "--parallel.dp_impl=ddp",
    "--parallel.grad_compression=powersgd",
    "--parallel.powersgd_rank=2",
    "--parallel.powersgd_warmup=2",
    "--train.ckpt_every=4",
    "--train.keep_last=5",
]


def _steps(run) -> list[dict]:
    return [r for r in records(run) if "loss" in r]


def test_powersgd_resumes_exactly(char_data, tmp_path):
    run = tmp_path / "r"
    assert run_inprocess(train_args(char_data, tmp_path, "r", STEPS, *FLAGS)) == 0
    first = {r["step"]: (r["loss"], r["allreduce_bytes"]) for r in _steps(run)}
    assert first[1][1] > 2 * first[3][1]  # compressed from step 3 on
    assert run_inprocess(["train", "--resume", str(run / "ckpt" / "step_000004"), *FLAGS[:2]]) == 0
    again = [r for r in _steps(run)][STEPS:]
    assert [r["step"] for r in again] == [5, 6, 7, 8]
    assert [(r["loss"], r["allreduce_bytes"]) for r in again] == [first[s] for s in (5, 6, 7, 8)]
