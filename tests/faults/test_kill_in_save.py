"""A rank SIGKILLed while a checkpoint is being written, under `loom train --nproc 3 --max-restarts`: the
launcher must stop the survivors within a bounded time whatever they are doing, start the group again, and the
run must resume from the newest complete checkpoint (never the half-written `step_N.tmp`) and end bit for bit
where an uninterrupted run ends.

Issue 59's chaos run (benchmarks/chaos.py, `results/cpu-2core-2026-12-02/chaos.md`) hung here: rank 2 died
inside DCP's gather of a save; rank 0, whose receive from it failed, went on to the save's outcome all-reduce,
while rank 1, which had sent its part, waited in DCP's broadcast from rank 0 (gdb: gloo's ring allreduce and
broadcast, each in UnboundBuffer::waitRecv). Neither could leave its wait, so neither ran its Python SIGTERM
handler, and the launcher sent SIGKILL only after parallel.timeout_s (600 s). The window inside torch is a few
milliseconds wide; here the survivors are held in the save deterministically instead: LOOM_FAULT_HOLD_SAVE
keeps rank 0 after its model files (it never lets go: a wait it cannot leave), so rank 1 waits for it inside
the optimizer's DCP collective, and rank 2 is killed from outside as a user or a cluster would.

Two halves, each tested here: the launcher SIGKILLs whatever still runs FAILED_GRACE_S after a rank's failure
(loom.train.spawn), and a rank whose DCP collective fails raises at once instead of entering the save's
agreement all-reduce (loom.checkpoint.save_sharded), so its peers' waits on it fail and they end by themselves
(16 kills of rank 2 inside saves, benchmarks/results/cpu-2core-2026-12-02/kill-in-save.md)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from faultkit import Proc, curve, rank_of, train_args, wait_for

from loom import checkpoint
from loom.distributed.comm import Control

STEPS, HELD_STEP = 12, 8
# batch 6: divisible by 3 processes; a save every 4 steps, so the newest complete one at the kill is step 4
ARGS = ("--train.ckpt_every=4", "--train.keep_last=10", "--train.batch_size=6")


def _release_all_but_the_first_hold(run, p: Proc, stuck: dict) -> None:
    """Every save holds rank 0 after its model files until HELD (holding the rank's pid) is deleted: delete each
    one at once, except the first rank 0's at step HELD_STEP, which stays held until that rank is killed."""
    while p.p.poll() is None:
        for held in (run / "ckpt").glob("step_*.tmp/HELD"):
            try:
                pid = int(held.read_text())
            except (OSError, ValueError):  # not written yet, or gone
                continue
            if held.parent.name == f"step_{HELD_STEP:06d}.tmp" and stuck.setdefault("pid", pid) == pid:
                continue
            held.unlink(missing_ok=True)
        time.sleep(0.01)


def test_rank_killed_inside_a_save_restarts_from_the_newest_complete_checkpoint(char_data, tmp_path):
    ref = Proc([*train_args(char_data, tmp_path, "ref", STEPS, *ARGS), "--nproc", "3"], tmp_path / "ref")
    assert ref.wait() == 0, ref.stderr()[-3000:]
    run = tmp_path / "r"
    args = [*train_args(char_data, tmp_path, "r", STEPS, *ARGS), "--nproc", "3", "--max-restarts", "1"]
    p = Proc(args, tmp_path / "out", env={"LOOM_FAULT_HOLD_SAVE": "1"})
    stuck: dict = {}
    threading.Thread(target=_release_all_but_the_first_hold, args=(run, p, stuck), daemon=True).start()
    wait_for(lambda: "pid" in stuck, p, what=f"rank 0 held in the save of step {HELD_STEP}")
    ranks = {rank_of(pid): pid for pid in p.tree()}
    assert ranks[0] == stuck["pid"] and 2 in ranks
    os.kill(ranks[2], signal.SIGKILL)
    # the old launcher waited parallel.timeout_s (600 s) here before its SIGKILL
    wait_for(lambda: "(restart)" in p.stdout(), p, timeout=90, what="the group's restart")
    assert p.wait() == 0, p.stderr()[-3000:]
    said = p.stdout() + p.stderr()
    # named: the held rank 0 (and rank 1, waiting for it inside gloo's all-gather, which no SIGTERM reaches)
    assert f"rank 0 (pid {ranks[0]})" in said and "s after the stop: SIGKILL" in said, said[-3000:]
    assert f"resumed from {run / 'ckpt' / 'step_000004'} at step 4" in said, said[-3000:]
    assert curve(run) == curve(tmp_path / "ref")  # bit for bit, the replayed steps 5-8 included
    ckpt = run / "ckpt"
    assert not list(ckpt.glob("*.tmp"))  # the killed attempt's half-written step 8 was removed, never read
    assert [s.name for s in checkpoint.list_steps(ckpt)] == [f"step_{s:06d}" for s in (4, 8, 12)]
    assert checkpoint.latest_valid(ckpt) == ckpt / "step_000012"


class _Counting(Control):
    """One process's control plane, counting the agreements (all-reduces) asked of it."""

    agreements = 0

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        self.agreements += 1
        return list(values)


def test_a_peer_lost_inside_the_save_is_raised_without_another_collective(tmp_path, monkeypatch):
    """What the survivor whose receive failed did in the chaos run: it went on to the agreement all-reduce and
    waited there for a peer still in DCP's broadcast. Now the error leaves the save at once."""

    def lost(sd, path, no_dist, group=None):
        raise torch.distributed.DistBackendError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5009")

    monkeypatch.setattr(checkpoint, "_dcp_save", lost)
    control = _Counting()
    with pytest.raises(torch.distributed.DistBackendError, match="Connection closed by peer"):
        checkpoint.save_sharded(tmp_path, 2, {"w": torch.ones(2)}, {}, {}, {"step": 2}, 3, control)
    assert control.agreements == 1  # the free-space agreement before the write; none after the lost peer
    assert checkpoint.list_steps(tmp_path) == [] and checkpoint.latest_valid(tmp_path) is None


def test_a_peer_lost_inside_a_background_save_is_raised_by_wait_without_an_agreement(tmp_path, monkeypatch):
    """The background save (train.async_ckpt) the same: the writer thread keeps the lost peer's error and
    wait() raises it on the training thread, with no agreement after it (before, the thread died with a
    traceback and wait() went on to the agreement all-reduce with the peers)."""
    from loom.faults import Faults
    from loom.train.checkpointing import Checkpointer, CheckpointJob, CheckpointPolicy

    control = _Counting()
    job = CheckpointJob(None, 2, True, "cpu", control, Faults(), lambda rec: None, lambda op: None)
    saver = Checkpointer(None, CheckpointPolicy(tmp_path, 3), job)

    def lost(*save):
        raise torch.distributed.DistBackendError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5009")

    monkeypatch.setattr(saver, "_write", lost)
    box: dict = {}
    writer = threading.Thread(target=saver._writer, args=(box, True, 4, {}, {}, control, None))
    saver._inflight = (4, box, writer)
    writer.start()
    with pytest.raises(torch.distributed.DistBackendError, match="Connection closed by peer"):
        saver.wait()
    assert control.agreements == 0
