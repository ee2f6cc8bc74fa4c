"""Non-finite steps: a NaN injected into one gradient (LOOM_FAULT_NAN_STEPS) is skipped, counted and
logged with its step and the parameter's name; the weights and optimizer state after a skipped step are
bit-identical to those before it; train.max_bad_steps in a row stop the run with the last good state
saved; with two ranks a NaN on one of them makes both skip. The guard's own rules (spike z-score, fp16
overflows) are checked directly."""

from __future__ import annotations

import math

import pytest
import torch
from faultkit import Proc, records, run_inprocess, train_args

from loom.train.guard import StepGuard

PARAM = "blocks.1.mlp.up_proj.weight"


def tensors(run, step: int, name: str) -> dict:
    from loom import checkpoint  # format 2: the whole tensors read back from the shards

    return checkpoint.load(run / "ckpt" / f"step_{step:06d}")[0][name.removesuffix(".pt")]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_nan_gradient_is_skipped_counted_and_changes_nothing(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOOM_FAULT_NAN_STEPS", "3")
    monkeypatch.setenv("LOOM_FAULT_NAN_PARAM", PARAM)
    run = tmp_path / "r"
    assert (
        run_inprocess(train_args(char_data, tmp_path, "r", 5, "--train.ckpt_every=1", "--train.keep_last=9"))
        == 0
    )
    out = capsys.readouterr().out
    assert f"step 3: update skipped, non-finite gradient norm (nan); non-finite gradients in {PARAM}" in out
    recs = {r["step"]: r for r in records(run) if "loss" in r}
    assert recs[3]["skipped"].startswith("non-finite") and recs[3]["bad_steps"] == 1
    assert recs[3]["nonfinite_params"] == [PARAM]
    assert all("skipped" not in recs[s] for s in (1, 2, 4, 5)) and all(
        math.isfinite(recs[s]["loss"]) for s in recs
    )
    assert records(run)[-1]["summary"]["skipped_steps"] == 1
    # no update at step 3: weights and optimizer state equal step 2's; step 4 moves on
    assert same(tensors(run, 2, "model.pt"), tensors(run, 3, "model.pt"))
    assert same(tensors(run, 2, "optim.pt"), tensors(run, 3, "optim.pt"))
    assert not same(tensors(run, 3, "model.pt"), tensors(run, 4, "model.pt"))


def test_max_bad_steps_in_a_row_saves_last_good_state_and_stops(char_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOOM_FAULT_NAN_STEPS", "3-")
    monkeypatch.setenv("LOOM_FAULT_NAN_PARAM", PARAM)
    run = tmp_path / "r"
    args = train_args(
        char_data, tmp_path, "r", 20, "--train.ckpt_every=2", "--train.max_bad_steps=3", "--train.keep_last=9"
    )
    assert run_inprocess(args) == 2
    err = capsys.readouterr().err
    assert (
        f"3 bad steps in a row (steps 3-5; last: non-finite gradient norm (nan)); non-finite gradients in: {PARAM}"
        in err
    )
    assert "The last good state (the weights after step 2) is saved as checkpoint step 5" in err
    assert same(tensors(run, 2, "model.pt"), tensors(run, 5, "model.pt"))
    assert records(run)[-1] == {
        "step": 5,
        "stopped": "max_bad_steps",
        "bad_steps": [3, 4, 5],
        "nonfinite_params": [PARAM],
    }


def test_nan_on_one_rank_makes_every_rank_skip(char_data, tmp_path):
    """Only rank 1 poisons its gradient, after DDP's all-reduce: had either rank stepped alone, the
    replicas would part and later losses turn NaN too; instead exactly one step is skipped."""
    run = tmp_path / "r"
    p = Proc(
        [*train_args(char_data, tmp_path, "r", 8), "--nproc", "2"],
        tmp_path / "out",
        env={"LOOM_FAULT_NAN_STEPS": "3", "LOOM_FAULT_NAN_RANK": "1"},
    )
    assert p.wait() == 0, p.stderr()[-3000:]
    recs = {r["step"]: r for r in records(run) if "loss" in r}
    assert [s for s, r in recs.items() if "skipped" in r] == [3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for s, r in recs.items() if s != 3)
    assert records(run)[-1]["summary"]["skipped_steps"] == 1


def test_guard_rules():
    g = StepGuard(max_bad_steps=2, spike_zscore=3.0, spike_window=5)
    for i, loss in enumerate([4.0, 4.1, 3.9, 4.0, 4.05], 1):
        assert g.check(i, loss, 1.0) is None
    assert "loss spike" in g.check(6, 9.0, 1.0)  # z ~ 70 over the window
    assert g.check(7, 4.02, 1.0) is None and g.in_row == 0  # a good step resets the run of bad ones
    assert g.check(8, 4.0, math.inf, scaler_enabled=True) is None  # fp16 overflow: the scaler's business
    assert "non-finite loss" in g.check(9, math.nan, 1.0)
    assert "non-finite gradient norm" in g.check(10, 4.0, math.nan)
    assert g.exhausted and g.skipped == 3 and g.bad_steps == [9, 10]
    off = StepGuard(max_bad_steps=1)  # spike guard off by default
    for i in range(200):
        assert off.check(i, 4.0 if i < 150 else 40.0, 1.0) is None


@pytest.mark.parametrize("bad", ["5,9-", "x"])
def test_fault_hook_parsing(bad, monkeypatch):
    from loom import faults
    from loom.errors import LoomError

    monkeypatch.setenv("LOOM_FAULT_NAN_STEPS", bad)
    if bad == "x":
        with pytest.raises(LoomError, match="LOOM_FAULT_NAN_STEPS"):
            faults.from_env()
        return
    f = faults.from_env()
    assert [s for s in range(1, 12) if f.nan_at(s, 0)] == [5, 9, 10, 11]
    assert faults.from_env({}) == faults.Faults()  # nothing set: every hook off
