"""The straggler monitor (issue 48, item 1) on 4 real gloo ranks: a rank made slow by LOOM_FAULT_SLOW_* in its
forward is named, with its phase and host, within two windows; a balanced run names no one. Compared against the
fault injected (which rank, which phase) and, for the balanced run, against no fault at all."""

from __future__ import annotations

import socket

from faultkit import Proc, records, train_args

WINDOW = 4
# 4 ranks on this 2-core machine wait for cores at random, more so beside the rest of the suite (a balanced
# run went past 0.3 of a step there): a threshold of 0.6 of the median step. The others wait for the slow rank
# in the step's collectives, so the median step holds its delay too: 300 ms of it is ~0.9 of a ~0.33 s step.
ARGS = [
    f"--train.straggler_every={WINDOW}",
    "--train.straggler_windows=2",
    "--train.straggler_threshold=0.6",
    "--nproc",
    "4",
]


def _windows(run):
    return [r["stragglers"] for r in records(run) if "stragglers" in r]


def test_slow_rank_is_named_with_its_phase(char_data, tmp_path):
    env = {"LOOM_FAULT_SLOW_RANK": "1", "LOOM_FAULT_SLOW_MS": "300", "LOOM_FAULT_SLOW_PHASE": "forward"}
    p = Proc([*train_args(char_data, tmp_path, "slow", 2 * WINDOW), *ARGS], tmp_path / "out", env=env)
    assert p.wait() == 0, p.stderr()[-3000:]
    windows = _windows(tmp_path / "slow")
    assert len(windows) == 2, windows
    named = [w["slowest"] for w in windows if w["slowest"]]
    assert named and named[0]["rank"] == 1 and named[0]["phase"] == "forward", windows
    assert named[0]["host"] == socket.gethostname() and named[0]["excess_s"] > 0.15
    assert all(len(w["step_s"]) == 4 and len(w["phases_s"]["forward"]) == 4 for w in windows)
    out = p.stdout() + p.stderr()
    assert f"rank 1 ({socket.gethostname()}) is the slowest" in out and "in forward" in out, out[-3000:]
    if len(named) == 2:  # two windows in a row (train.straggler_windows=2): the warning
        assert "for 2 windows of 4 steps in a row" in out


def test_balanced_run_names_no_one(char_data, tmp_path):
    p = Proc([*train_args(char_data, tmp_path, "even", 2 * WINDOW), *ARGS], tmp_path / "out")
    assert p.wait() == 0, p.stderr()[-3000:]
    windows = _windows(tmp_path / "even")
    assert len(windows) == 2 and not any(w["slowest"] for w in windows), windows
