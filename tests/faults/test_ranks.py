"""Dead and hung ranks under `loom train --nproc N` (gloo, loopback): the job must end within the
collective timeout, name the rank, and leave no process behind; the rendezvous listens on 127.0.0.1
only. Compared against the timeout given (parallel.timeout_s) and the process table."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from faultkit import Proc, alive, last_step, listening_addresses, rank_of, train_args, wait_for

TIMEOUT_S = 5


@pytest.mark.parametrize("nproc", [2, 4])
def test_killed_rank_ends_the_job_within_the_timeout(char_data, tmp_path, nproc):
    run = tmp_path / "kill"
    args = [
        *train_args(char_data, tmp_path, "kill", 100_000, f"--parallel.timeout_s={TIMEOUT_S}"),
        "--nproc",
        str(nproc),
    ]
    p = Proc(args, tmp_path / "out")
    wait_for(lambda: last_step(run) >= 3, p, what="step 3")
    tree = p.tree()
    # the launcher, multiprocessing's fork server (and resource tracker, unless the launcher is itself a fork
    # that inherited one), and the workers, each named `loom rank N`
    assert 2 <= len([pid for pid in tree if rank_of(pid) is None]) <= 3, tree
    # the workers' parent is a fork of the launcher (spawn.own_server), not a new interpreter's fork server
    servers = {
        Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[1]
        for pid in tree
        if rank_of(pid) is not None
    }
    assert len(servers) == 1 and Path(f"/proc/{servers.pop()}/comm").read_text().strip() == "loom server"
    assert sorted(r for r in map(rank_of, tree) if r is not None) == list(range(nproc))
    listening = listening_addresses(tree)
    assert listening and all(a.startswith("127.0.0.1:") for a in listening), listening
    victim = [pid for pid in tree if rank_of(pid) == nproc - 1]
    os.kill(victim[0], signal.SIGKILL)
    t0 = time.monotonic()
    rc = p.wait(timeout=60)
    took = time.monotonic() - t0
    assert rc != 0
    assert took < TIMEOUT_S + 5, took
    err = p.stderr()
    assert f"rank {nproc - 1} (pid {victim[0]}) failed first: SIGKILL" in err
    assert not alive(tree)
    print(
        f"\n[fault] SIGKILL rank {nproc - 1} of {nproc}: job ended {took:.1f}s later, rank named, "
        f"{len(tree)} processes gone; listening only on {sorted(set(a.split(':')[0] for a in listening))}"
    )


def test_hung_rank_times_out_naming_the_operation_and_the_rank(char_data, tmp_path):
    """Rank 1 stops before the collectives of step 5; rank 0 waits parallel.timeout_s in the gradient
    all-reduce, then fails naming it and rank 1; the launcher stops rank 1 (which cannot finish its step
    within the timeout after SIGTERM either) and nothing is left."""
    run = tmp_path / "hang"
    args = [
        *train_args(char_data, tmp_path, "hang", 100_000, f"--parallel.timeout_s={TIMEOUT_S}"),
        "--nproc",
        "2",
    ]
    p = Proc(args, tmp_path / "out", env={"LOOM_FAULT_HANG_STEP": "5", "LOOM_FAULT_HANG_RANK": "1"})
    wait_for(lambda: last_step(run) >= 4, p, what="step 4")
    t0 = time.monotonic()
    tree = p.tree()
    rc = p.wait(timeout=90)
    took = time.monotonic() - t0
    err = p.stderr()
    assert rc != 0
    assert (
        "rank 0: the forward/backward collectives of step 5 (gradient all-reduce) did not complete within "
        f"parallel.timeout_s={TIMEOUT_S}s" in err
    ), err[-3000:]
    assert "did not arrive at step 5: rank 1 (last began step 4)" in err
    assert "rank 1 (exit code 143)" in err  # it gave up parallel.timeout_s after the launcher's SIGTERM
    assert TIMEOUT_S - 1 < took < 2 * TIMEOUT_S + 8, took
    assert not alive(tree)
    print(
        f"\n[fault] rank 1 of 2 hung at step 5 (timeout {TIMEOUT_S}s): collective error naming the "
        f"operation and rank 1, job ended {took:.1f}s after the last good step"
    )
