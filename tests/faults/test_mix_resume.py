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


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (
            "--data.mix_schedule=6@web:0.1,code:0.1,math:0.8",
            "data.mix_schedule",
        ),  # after the checkpoint's step
        ("--data.mix_schedule=2@web:0.1,code:0.1,math:0.8", "data.mix_schedule"),  # before it
        ("--data.mix=web:0.4,code:0.4,math:0.2", "data.mix"),
    ],
    ids=["schedule-after", "schedule-before", "weights"],
)
def test_a_resume_with_another_mixture_is_refused_and_config_toml_kept(
    mix_sources, tmp_path, capsys, change, key
):
    """docs/data.md: a resume with another mixture or schedule is refused. A schedule changed only after the
    checkpoint's step passed the loader's cursor comparison and trained on (config.toml rewritten with it); one
    changed before it was refused by the loader after config.toml had been rewritten, so the next plain
    --resume read the wrong schedule. Now both are refused before the run folder changes."""
    args = train_args(mix_sources["web"], tmp_path, "m", 4, *mix_flags(mix_sources))
    assert run_inprocess([a for a in args if not a.startswith("--data.path=")]) == 0
    run = tmp_path / "m"
    config, metrics = (run / "config.toml").read_bytes(), (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert run_inprocess(["train", "--resume", str(run), "--train.steps=8", change]) == 2
    err = capsys.readouterr().err
    assert f"this resume gives {key}=" in err and "keeps the mixture it started with" in err, err
    assert (run / "config.toml").read_bytes() == config and (run / "metrics.jsonl").read_bytes() == metrics
    assert run_inprocess(["train", "--resume", str(run), "--train.steps=6"]) == 0  # the run's own mixture
