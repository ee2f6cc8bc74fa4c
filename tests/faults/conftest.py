"""Uninterrupted reference runs, shared by the tests that kill, stop and resume the same configuration."""

from __future__ import annotations

import pytest
from faultkit import CKPT, STARTED, STEPS, Proc, curve, run_inprocess, train_args


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """A test that fails before its job ends (most train 100,000 steps) would leave the job running on."""
    yield
    while STARTED:
        p = STARTED.pop()
        if p.p.poll() is None:
            p.kill_all()


@pytest.fixture(scope="session")
def ref_one(char_data, tmp_path_factory) -> dict[int, float]:
    """The loss curve of an uninterrupted one-process run."""
    runs = tmp_path_factory.mktemp("ref1")
    assert run_inprocess(train_args(char_data, runs, "ref", STEPS, *CKPT)) == 0
    c = curve(runs / "ref")
    assert sorted(c) == list(range(1, STEPS + 1))
    return c


@pytest.fixture(scope="session")
def ref_two_run(char_data, tmp_path_factory):
    """The run directory of an uninterrupted two-process (DDP, gloo) run (its checkpoints: every CKPT step)."""
    runs = tmp_path_factory.mktemp("ref2")
    p = Proc([*train_args(char_data, runs, "ref", STEPS, *CKPT), "--nproc", "2"], runs / "out")
    assert p.wait() == 0, p.stderr()[-3000:]
    return runs / "ref"


@pytest.fixture(scope="session")
def ref_two(ref_two_run) -> dict[int, float]:
    """The loss curve of that run."""
    c = curve(ref_two_run)
    assert sorted(c) == list(range(1, STEPS + 1))
    return c
