"""data.mix under SIGKILL: a three-source mixture with a schedule switch is killed at a random step and
continued with --resume; the concatenated loss curve equals, bit for bit, an uninterrupted run of the same
configuration (conftest's way, on the mixture), and the realised tokens of each source continue the
uninterrupted run's. The step to kill at is drawn from LOOM_FAULT_SEED (printed, so a failure can be
replayed)."""

from __future__ import annotations

import os
import random
import time

import pytest
from faultkit import CKPT, STEPS, Proc, curve, last_step, records, run_inprocess, train_args, wait_for
from mixkit import make_sources, mix_flags

from loom.metrics import read_jsonl

SEED = int(os.environ.get("LOOM_FAULT_SEED", str(time.time_ns() % 100_000)))
SCHEDULE = "--data.mix_schedule=20@web:0.1,code:0.1,math:0.8"


def mix_args(sources, runs, name: str) -> list[str]:
    args = train_args(sources["web"], runs, name, STEPS, *CKPT, *mix_flags(sources), SCHEDULE)
    return [a for a in args if not a.startswith("--data.path=")]


def mix_tokens(run) -> dict[int, dict]:
    return {r["step"]: r["mix_tokens"] for r in read_jsonl(run / "metrics.jsonl") if "mix_tokens" in r}


@pytest.fixture(scope="module")
def mix_sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("mixsrc"))


def test_sigkill_mixture_then_resume_is_bit_identical(mix_sources, tmp_path):
    assert run_inprocess(mix_args(mix_sources, tmp_path, "ref")) == 0
    ref = curve(tmp_path / "ref")
    assert sorted(ref) == list(range(1, STEPS + 1))
    k = random.Random(SEED).randint(8, STEPS - 10)
    run = tmp_path / "r"
    p = Proc(mix_args(mix_sources, tmp_path, "r"), tmp_path / "first")
    wait_for(lambda: last_step(run) >= k, p, what=f"step {k}")
    p.kill_all()
    before = len(records(run))
    r = Proc(["train", "--resume", str(run)], tmp_path / "resume")
    wait_for(lambda: len(records(run)) > before, r, what="the first step after --resume")
    assert r.wait() == 0, r.stderr()[-3000:]
    assert curve(run) == ref
    final = [r for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl") if r.get("step") == STEPS]
    for name in ("web", "code", "math"):  # each source's own val loss and bits per byte, at the last step
        assert any(f"val_loss/{name}" in r and f"val_bpb/{name}" in r for r in final), final
    want, got = mix_tokens(tmp_path / "ref"), mix_tokens(run)
    assert got == want
    # the schedule's switch at step 20 shows in the realised tokens: math takes 0.8 of the rows from there
    per_step = 8 * 16
    gained = {n: want[STEPS][n] - want[20][n] for n in want[20]}
    assert gained["math"] >= 0.75 * (STEPS - 20) * per_step
    print(f"\n[fault] data.mix SIGKILL at step >= {k} (seed {SEED}): resumed bit-identical")
