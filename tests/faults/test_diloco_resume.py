"""DiLoCo killed and resumed: SIGKILL in the middle of inner steps, then again once a later outer step's
checkpoint is written, each time followed by --resume; the concatenated loss curve is compared, bit for bit, with an uninterrupted run of the same
configuration (two processes, two DiLoCo replicas of one ddp rank each, H = 4, a checkpoint every outer step).
A kill between outer steps loses the inner steps since the last one: they are replayed, exactly."""

from __future__ import annotations

from faultkit import Proc, alive, curve, last_step, records, run_inprocess, train_args, wait_for

from loom import checkpoint

STEPS, H = 16, 4
DILOCO = [
    "--nproc",
    "2",
    "--parallel.dp_impl=ddp",
    "--parallel.dp_replicate=2",
    f"--parallel.diloco_inner_steps={H}",
    f"--train.ckpt_every={H}",
    "--train.keep_last=10",
]


def _saved(run) -> int:
    newest = checkpoint.latest_valid(run / "ckpt")
    return int(newest.name.removeprefix("step_")) if newest else 0


def _kill_when(run, p: Proc, cond, what: str) -> int:
    wait_for(cond, p, what=what)
    tree = p.tree()
    p.kill_all()
    assert not alive(tree)
    return last_step(run)


def test_diloco_killed_mid_inner_steps_and_after_an_outer_step_resumes_exactly(char_data, tmp_path):
    ref = Proc(train_args(char_data, tmp_path, "ref", STEPS, *DILOCO), tmp_path / "ref")
    assert ref.wait() == 0, ref.stderr()[-3000:]
    want = curve(tmp_path / "ref")
    outer = [r["step"] for r in records(tmp_path / "ref") if "outer_step" in r]
    assert outer == [4, 8, 12, 16]

    run = tmp_path / "r"
    p = Proc(train_args(char_data, tmp_path, "r", STEPS, *DILOCO), tmp_path / "first")
    killed = _kill_when(run, p, lambda: last_step(run) >= 6, "step 6")  # mid inner steps (5-8)
    saved = _saved(run)
    assert saved in (4, 8) and saved <= killed, (saved, killed)
    p = Proc(["train", "--resume", str(run), *DILOCO[:2]], tmp_path / "second")
    # after an outer step's checkpoint (step 12), during the next inner steps
    second = _kill_when(run, p, lambda: _saved(run) >= 12, "the checkpoint of step 12")
    assert _saved(run) >= 12
    p = Proc(["train", "--resume", str(run), *DILOCO[:2]], tmp_path / "third")
    assert p.wait() == 0, p.stderr()[-3000:]
    assert curve(run) == want  # every step, replayed ones included, as the uninterrupted run
    print(f"\n[fault] DiLoCo H={H}: killed at step {killed} (resumed from {saved}), then at {second}: exact")


# FSDP inside each replica: 4 processes, 2 replicas of 2 FSDP shards; H = 2, 4 steps, a checkpoint every outer step
FSDP_INSIDE = [
    "--nproc",
    "4",
    "--parallel.dp_impl=fsdp",
    "--parallel.dp_replicate=2",
    "--parallel.diloco_inner_steps=2",
    "--train.ckpt_every=2",
    "--train.keep_last=5",
]


def test_diloco_with_fsdp_inside_resumes_exactly(char_data, tmp_path):
    """DiLoCo across 2 replicas with FSDP sharding inside each: `--resume` from the checkpoint of outer step 1
    (step 2) replays steps 3-4, whose losses and outer steps equal the first run's bit for bit (the sharded
    inner optimizer state of each replica, the outer momentum as DTensor shards)."""
    run = tmp_path / "r"
    assert run_inprocess(train_args(char_data, tmp_path, "r", 4, *FSDP_INSIDE)) == 0
    first = {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    assert [r["step"] for r in records(run) if "outer_step" in r] == [2, 4]
    assert run_inprocess(["train", "--resume", str(run / "ckpt" / "step_000002"), *FSDP_INSIDE[:2]]) == 0
    again = [r for r in records(run) if "loss" in r][4:]
    assert [(r["step"], r["loss"]) for r in again] == [(s, first[s]) for s in (3, 4)]
