"""torchft replica groups of several processes: each group an FSDP shard group, the groups HSDP's replicate
dimension (`loom train --nproc 4 --parallel.dp_impl=fsdp --parallel.dp_replicate=2 --ft.enabled=true`), with
real processes. Compared against the same layout without ft (HSDP, `--nproc 4`: the weights bit for bit when
nothing fails), and against each other after one rank of a group is SIGKILLed: the whole group is started
again and heals from the live group (its checkpoints then equal the live group's bit for bit)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from faultkit import Proc, records, wait_for
from loomrun import loom_run
from proctree import descendants
from test_ft_ddp import args, assert_healed, assert_same, ft_records, weights

pytest.importorskip("torchft", reason="the ft extra (pip install loom[ft])")
HSDP = ("--parallel.dp_impl=fsdp", "--parallel.dp_replicate=2")
STEPS = 12


def test_ft_hsdp_equals_hsdp_without_failures(char_data, tmp_path):
    """2 groups of 2 FSDP ranks with no failure = HSDP 2 x 2, bit for bit; every step over both groups."""
    hsdp = Proc(args(char_data, tmp_path, "hsdp", STEPS, *HSDP, nproc="4"), tmp_path / "hsdp")
    assert hsdp.wait(300) == 0, hsdp.stderr()[-3000:]
    extra = (*HSDP, "--ft.enabled=true", "--ft.min_replicas=2")
    ft = Proc(args(char_data, tmp_path, "ft", STEPS, *extra, nproc="4"), tmp_path / "ft")
    assert ft.wait(300) == 0, ft.stderr()[-3000:]
    assert_same(weights(tmp_path / "hsdp", STEPS), weights(tmp_path / "ft", STEPS))
    assert_same(weights(tmp_path / "ft", STEPS), weights(tmp_path / "ft-g1", STEPS))
    steps = [r for r in records(tmp_path / "ft") if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert {r["ft_replicas"] for r in steps} == {2} and steps[-1]["ft_rows_skipped"] == 0
    (first,) = ft_records(tmp_path / "ft")
    assert first["replicas"] == [0, 1] and first["left"] == []


def rank_pids(job: Proc, k: int) -> list[int]:
    """The rank processes of replica group k (children of its launcher, `loom ft g<k>`)."""
    out = []
    for pid in descendants(job.pid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"loom ft g{k}":
                out += [p for p in descendants(pid) if _comm(p).startswith("loom rank")]
        except OSError:
            continue
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_killed_rank_restarts_its_group_which_heals_bitwise(char_data, tmp_path):
    """SIGKILL rank 1 of group 1: the group's launcher stops its other rank, the job's launcher starts the
    group again, both its ranks heal from group 0's same-rank processes (their shards, optimizer, loader,
    step), and the groups' final checkpoints hold the same weights bit for bit."""
    steps = 60
    extra = (*HSDP, "--ft.enabled=true", "--parallel.timeout_s=30")
    job = Proc(args(char_data, tmp_path, "job", steps, *extra, nproc="4"), tmp_path / "job")
    run0, run1 = tmp_path / "job", tmp_path / "job-g1"
    wait_for(lambda: len(records(run1)) > 6, job, timeout=240, what="group 1's steps")
    ranks = rank_pids(job, 1)
    assert len(ranks) == 2, ranks
    os.kill(max(ranks), signal.SIGKILL)  # the later-started rank: rank 1 of the group
    assert job.wait(300) == 0, job.stderr()[-3000:]
    assert "replica group 1 ended" in job.stdout() + job.stderr()
    assert_healed(run0, run1, steps)


def test_verify_has_an_ft_hsdp_strategy(tmp_path):
    """`loom verify --strategies ft-hsdp`: 2 groups of 2 FSDP ranks against one process, within verify's
    tolerance (the same as hsdp's: ft-hsdp equals hsdp bit for bit, the test above)."""
    r = loom_run(
        "verify",
        "--strategies",
        "ft-hsdp",
        "--nproc",
        "4",
        "--steps",
        "4",
        "--out",
        str(tmp_path),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ft-hsdp" in r.stdout and "pass" in r.stdout and "fail" not in r.stdout
