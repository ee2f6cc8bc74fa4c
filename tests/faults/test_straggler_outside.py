"""A rank slowed from outside loom (issue 59, item 4): the test itself stops one rank process of a 2- or 3-rank
DDP run, a 2-rank FSDP run or a 2-stage pipeline (SIGSTOP, then SIGCONT, on a duty cycle: stopped 80 % of the
time), as a user's other job, a throttled host or a slow device would, with nothing in loom told about it. The
other ranks wait for it inside their backward (DDP's overlapped gradient all-reduce, FSDP's all-gathers and
reduce-scatters) or the schedule (the pipeline's sends and receives), where the straggler monitor now measures
the wait: the stopped rank is warned about within train.straggler_windows windows of the slowdown. The same runs
unslowed warn about no one. Compared against the rank the test stops, and for the balanced runs against no
slowdown at all."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from faultkit import Proc, descendants, last_step, rank_of, records, train_args, wait_for

WINDOW, WINDOWS, STEPS = 4, 2, 20
# The stopped rank is stopped 80 % of the wall clock and the others wait for it, in their backward (DDP's
# buckets) and in the step's scalar collectives. A stop that lands while it is itself inside a collective holds
# every rank there alike; its own watch (Stalls) counts that share as its time. Measured beside other jobs
# (benchmarks/results/cpu-2core-2026-12-02/stragglers.md): its excess 0.77-0.81 of a step in every slowed
# window; a balanced run's largest 0.30, in single windows, a different rank each time (3 ranks on 2 busy
# cores: one of them waits for a core at any moment). The threshold, 0.45, lies between, and a warning needs
# 2 windows in a row.
ARGS = [
    f"--train.straggler_every={WINDOW}",
    f"--train.straggler_windows={WINDOWS}",
    "--train.straggler_threshold=0.45",
    "--model.n_embd=128",
    "--model.block_size=64",
    "--train.batch_size=12",  # divisible by 2 and 3 ranks
]
STOPPED_S, RUNNING_S = 0.08, 0.02  # the duty cycle: 80 ms stopped, 20 ms running
# (ranks, extra keys): the layouts whose waits the monitor measures (benchmarks/results/cpu-2core-2026-12-02/
# stragglers.md has each one's figures)
LAYOUTS = {
    "ddp-2": ("2", []),  # two: told apart only because the waits are measured
    "ddp-3": ("3", []),
    "fsdp-2": ("2", ["--parallel.dp_impl=fsdp"]),
    "hsdp-2": ("2", ["--parallel.dp_impl=fsdp", "--parallel.dp_replicate=2"]),  # waits across replicas
    "pp-2": ("2", ["--parallel.pp=2", "--parallel.pp_microbatches=2"]),
}


def _windows(run) -> list[dict]:
    return [{"step": r["step"], **r["stragglers"]} for r in records(run) if "stragglers" in r]


def _rank_pid(p: Proc, rank: int) -> int:
    found: list[int] = []
    wait_for(lambda: found.extend(q for q in descendants(p.pid) if rank_of(q) == rank) or found, p)
    return found[0]


class DutyCycle(threading.Thread):
    """SIGSTOP and SIGCONT `pid` in turn until stopped; the process is left running."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.done = pid, threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                time.sleep(STOPPED_S)
                os.kill(self.pid, signal.SIGCONT)
                self.done.wait(RUNNING_S)
        except ProcessLookupError:  # the run ended
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_stopped_from_outside_is_warned_about(char_data, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    args = [*train_args(char_data, tmp_path, "stopped", STEPS), *ARGS, *extra, "--nproc", nproc]
    p = Proc(args, tmp_path / "out")
    pid = _rank_pid(p, 1)
    # the first window is unslowed (the run's start-up is left alone: stopped 80 % it would take 5 times
    # as long); the slowdown starts when rank 0 has written it
    wait_for(lambda: _windows(tmp_path / "stopped"), p, what="the first straggler window")
    cycle = DutyCycle(pid)
    cycle.start()
    # rank 0 logs a step after every rank has taken part in its collectives: the ranks are at most a step
    # further, so every step from `began` on is slowed
    began = last_step(tmp_path / "stopped") + 2
    try:
        assert p.wait() == 0, p.stderr()[-3000:]
    finally:
        cycle.done.set()
        cycle.join()
    windows = _windows(tmp_path / "stopped")
    assert len(windows) == STEPS // WINDOW and all(w["waits_measured"] for w in windows), windows
    slowed = [w for w in windows if w["step"] - WINDOW + 1 >= began]  # wholly slowed
    assert len(slowed) >= WINDOWS
    # every wholly slowed window names rank 1; the streak reaches train.straggler_windows in the
    # WINDOWS-th at the latest: the warning
    assert all(w["slowest"] and w["slowest"]["rank"] == 1 for w in slowed), windows
    assert slowed[WINDOWS - 1]["slowest"]["in_a_row"] >= WINDOWS, windows
    # the others waited for it in collectives (most of their step), rank 1 hardly at all
    waits = slowed[-1]["phases_s"]["wait"]
    others = [w for r, w in enumerate(waits) if r != 1]
    assert waits[1] < min(others) and slowed[-1]["slowest"]["others_wait_frac"] > 0.3, windows
    out = p.stdout() + p.stderr()
    assert f"has been the slowest rank, by more than 45% of a step, for {WINDOWS} windows" in out, out[-3000:]
    assert "warning: rank 1 (" in out


@pytest.mark.parametrize("layout", ["ddp-3", "fsdp-2", "hsdp-2", "pp-2"])
def test_balanced_run_warns_about_no_one(char_data, tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    args = [*train_args(char_data, tmp_path, "even", STEPS), *ARGS, *extra, "--nproc", nproc]
    p = Proc(args, tmp_path / "out")
    assert p.wait() == 0, p.stderr()[-3000:]
    windows = _windows(tmp_path / "even")
    assert len(windows) == STEPS // WINDOW and all(w["waits_measured"] for w in windows), windows
    assert all(len(w["phases_s"]["wait"]) == int(nproc) for w in windows)
    out = p.stdout() + p.stderr()
    assert "has been the slowest rank" not in out, out[-3000:]
