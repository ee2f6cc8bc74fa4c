"""DiLoCo across torchft replica groups (`--parallel.dp_replicate=2 --parallel.diloco_inner_steps=H
--ft.enabled=true`: each group one DiLoCo replica, the outer step's all-reduce through the group's torchft
manager, a quorum at each window's first step), with real processes. Compared against loom's DiLoCo without ft
(the same layout: the weights bit for bit when nothing fails), and against each other after a group is
SIGKILLed, started again and healed from the live group at a window's start (bitwise)."""

from __future__ import annotations

import pytest
from faultkit import Proc, records
from loomrun import loom_run
from test_ft_ddp import args, assert_healed, assert_same, ft_records, kill_group, weights

pytest.importorskip("torchft", reason="the ft extra (pip install loom[ft])")
H = 4
DILOCO = ("--parallel.dp_replicate=2", f"--parallel.diloco_inner_steps={H}")


def test_ft_diloco_equals_diloco_without_failures(char_data, tmp_path):
    """2 groups with no failure = DiLoCo over 2 replicas, bit for bit: the same inner steps, the same outer
    gradient summed over two and halved; one quorum, every outer step over both groups."""
    steps = 3 * H
    ref = Proc(args(char_data, tmp_path, "diloco", steps, *DILOCO), tmp_path / "diloco")
    assert ref.wait(300) == 0, ref.stderr()[-3000:]
    extra = (*DILOCO, "--ft.enabled=true", "--ft.min_replicas=2")
    ft = Proc(args(char_data, tmp_path, "ft", steps, *extra), tmp_path / "ft")
    assert ft.wait(300) == 0, ft.stderr()[-3000:]
    assert_same(weights(tmp_path / "diloco", steps), weights(tmp_path / "ft", steps))
    assert_same(weights(tmp_path / "ft", steps), weights(tmp_path / "ft-g1", steps))
    outer = [r for r in records(tmp_path / "ft") if "outer_step" in r]
    assert [r["step"] for r in outer] == [H, 2 * H, 3 * H] and all(r["outer_bytes"] > 0 for r in outer)
    (first,) = ft_records(tmp_path / "ft")  # one quorum, at step 0, never changed
    assert first["replicas"] == [0, 1] and first["left"] == []


def test_killed_group_heals_at_a_window_start_bitwise(char_data, tmp_path):
    """SIGKILL group 1 mid-run: group 0's outer step in flight is not committed (its window undone) or goes on
    alone; group 1 is started again, heals from group 0 at a window's first step (weights = the anchor,
    inner optimizer, outer momentum, loader, step) and both end with the same weights bit for bit."""
    steps = 30 * H
    job = Proc(args(char_data, tmp_path, "job", steps, *DILOCO, "--ft.enabled=true"), tmp_path / "job")
    run0, run1 = tmp_path / "job", tmp_path / "job-g1"
    kill_group(job, run1, 1, after=2 * H + 1)
    assert job.wait(300) == 0, job.stderr()[-3000:]
    assert_healed(run0, run1, steps)


def test_verify_has_an_ft_diloco_strategy(tmp_path):
    """`loom verify --strategies ft-diloco`: judged as diloco is (the final loss's gap to one process)."""
    r = loom_run(
        "verify",
        "--strategies",
        "ft-diloco",
        "--nproc",
        "2",
        "--steps",
        "10",
        "--out",
        str(tmp_path),
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ft-diloco" in r.stdout and "pass" in r.stdout and "fail" not in r.stdout
