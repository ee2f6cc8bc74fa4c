"""SIGKILL at a random step, then continue: the concatenated loss curve is compared, bit for bit, with an
uninterrupted run of the same configuration (CPU, fp32, dropout on; conftest's references): one process
resumed with --resume, two processes resumed with --nproc 2 --resume, and two processes restarted by
the elastic agent (--max-restarts) after one rank is killed. The step to kill at is drawn from
LOOM_FAULT_SEED (printed, so a failure can be replayed)."""

from __future__ import annotations

import os
import random
import shutil
import time

from faultkit import (
    CKPT,
    STEPS,
    Proc,
    alive,
    curve,
    last_step,
    rank_of,
    records,
    run_inprocess,
    train_args,
    wait_for,
)

from loom import checkpoint
from loom.metrics import read_jsonl

SEED = int(os.environ.get("LOOM_FAULT_SEED", str(time.time_ns() % 100_000)))


def kill_step(salt: int) -> int:
    return random.Random(SEED + salt).randint(8, STEPS - 10)


def saved_step(run) -> int:
    newest = checkpoint.latest_valid(run / "ckpt")
    assert newest is not None
    return int(newest.name.removeprefix("step_"))


def _kill_then_resume(char_data, tmp_path, ref, nproc: int) -> None:
    k = kill_step(nproc)
    run = tmp_path / "r"
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    p = Proc([*train_args(char_data, tmp_path, "r", STEPS, *CKPT), *launch], tmp_path / "first")
    wait_for(lambda: last_step(run) >= k, p, what=f"step {k}")
    tree = p.tree()
    p.kill_all()  # the whole job at once, as a lost node would
    killed_at = last_step(run)
    assert killed_at < STEPS and not alive(tree)
    first = curve(run)
    saved = saved_step(run)
    assert killed_at - 6 <= saved <= killed_at  # ckpt_every=6: at most one interval lost
    t0, before = time.monotonic(), len(records(run))
    r = Proc(["train", "--resume", str(run), *launch], tmp_path / "resume")
    wait_for(lambda: len(records(run)) > before, r, what="the first step after --resume")
    recovered = time.monotonic() - t0
    assert r.wait() == 0, r.stderr()[-3000:]
    assert f"resumed from {run / 'ckpt' / f'step_{saved:06d}'}" in r.stdout()
    diff = [(s, first[s], ref[s]) for s in first if first[s] != ref[s]]
    assert not diff, diff[:5]  # the killed attempt followed the reference
    assert curve(run) == ref  # and the resumed one continues it exactly
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert steps == sorted(ref)  # one timeline: the replayed steps replace the killed attempt's (issue 27)
    print(
        f"\n[fault] SIGKILL {nproc} proc at step {killed_at} (seed {SEED}): resumed from step {saved}, "
        f"{killed_at - saved} steps to replay, first step logged {recovered:.1f}s after --resume"
    )


def test_sigkill_one_process_then_resume_is_bit_identical(char_data, tmp_path, ref_one):
    _kill_then_resume(char_data, tmp_path, ref_one, 1)


def test_sigkill_two_processes_then_resume_is_bit_identical(char_data, tmp_path, ref_two):
    _kill_then_resume(char_data, tmp_path, ref_two, 2)


def test_killed_rank_elastic_restart_continues_bit_identical(char_data, tmp_path, ref_two):
    """--max-restarts 1: rank 1 is SIGKILLed; the agent restarts both workers, which find the run's
    newest checkpoint by themselves (TORCHELASTIC_RESTART_COUNT) and finish the same curve."""
    k = kill_step(3)
    run = tmp_path / "r"
    args = [*train_args(char_data, tmp_path, "r", STEPS, *CKPT), "--nproc", "2", "--max-restarts", "1"]
    p = Proc(args, tmp_path / "elastic")
    wait_for(lambda: last_step(run) >= k, p, what=f"step {k}")
    victim = [c for c in p.tree() if rank_of(c) == 1]
    assert victim
    os.kill(victim[0], 9)
    t0 = time.monotonic()
    wait_for(lambda: "(restart)" in p.stdout(), p, what="the restart")
    before = len(records(run))  # the restarted group logs nothing before it says it is continuing
    wait_for(lambda: len(records(run)) > before, p, what="the restarted group's first step")
    recovered = time.monotonic() - t0
    assert p.wait() == 0, p.stderr()[-3000:]
    assert "continuing" in p.stdout() and "(restart)" in p.stdout()
    assert curve(run) == ref_two
    print(
        f"\n[fault] SIGKILL rank 1 of 2 at step {k} (seed {SEED}), --max-restarts 1: the group restarted "
        f"and logged its first step {recovered:.1f}s after the kill"
    )


def test_two_ranks_hash_their_own_shards_and_fall_back_together(tmp_path, ref_two_run, ref_two):
    """Rank 1 hashes the shard it wrote; its corrupt optimizer shard in the newest step sends both ranks back
    to the step before, and the curve from there equals the uninterrupted run's."""
    run = tmp_path / "ref"
    shutil.copytree(ref_two_run, run)
    for step in checkpoint.list_steps(run / "ckpt"):
        if int(step.name[5:]) > 18:
            shutil.rmtree(step)
    shard = run / "ckpt" / "step_000018" / "optim" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a hash finds it
    shard.write_bytes(bytes(data))
    (run / "metrics.jsonl").unlink()
    p = Proc(["train", "--resume", str(run), "--nproc", "2"], tmp_path / "out")
    assert p.wait() == 0, p.stderr()[-3000:]
    said = p.stdout() + p.stderr()
    assert "skipping checkpoint" in said and "step_000018/optim/__1_0.distcp' does not match" in said, said[
        -3000:
    ]
    c = curve(run)
    assert sorted(c) == list(range(13, STEPS + 1)) and all(c[s] == ref_two[s] for s in c)


def test_steps_trained_again_after_a_resume_replace_the_abandoned_ones(char_data, tmp_path, capsys):
    """Issue 27 item 7: resumed from an earlier checkpoint, the steps trained again appeared twice in
    metrics.jsonl and `loom plot` drew the curve doubling back. Every reader now sees one timeline: the
    resumed run's records of those steps, none of the abandoned ones (which stay in the file)."""
    run = tmp_path / "r"
    args = train_args(char_data, tmp_path, "r", 8, "--train.ckpt_every=4", "--train.keep_last=5")
    assert run_inprocess(args) == 0
    first = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}
    assert run_inprocess(["train", "--resume", str(run / "ckpt" / "step_000004"), "--optim.lr=0.0123"]) == 0
    recs = read_jsonl(run / "metrics.jsonl")
    steps = [(r["step"], r["lr"]) for r in recs if "loss" in r]
    assert [s for s, _ in steps] == list(range(1, 9))
    assert all(lr == first[s]["lr"] for s, lr in steps[:4])  # before the resume: the first run's records
    assert all(lr != first[s]["lr"] for s, lr in steps[4:7])  # after: the resumed run's (another optim.lr)
    raw = read_jsonl(run / "metrics.jsonl", superseded=True)
    assert len([r for r in raw if "loss" in r]) == 12 and {"resumed_from": 4} in raw
    from loom.cli import main

    assert main(["plot", str(run)]) == 0 and (run / "loss.png").is_file()
