"""benchmarks/vs_nanogpt.py's parsing and timing against log lines in both tools' formats (loom's made by
loom.metrics.format_step, nanoGPT's copied from its train.py): the right lines are picked and steps with an
evaluation or a pause are left out of tokens/s. nanoGPT itself is not needed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from loom.metrics import format_step

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_nanogpt.py"


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("vs_nanogpt", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vs_nanogpt"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_regexes_match_both_formats(vs):
    rec = {
        "step": 12,
        "loss": 2.5,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "dt": 0.0375,
        "dtf": 0.01,
        "dtb": 0.02,
        "tokens_per_s": 20000.0,
        "mfu": 0.5,
        "mem_bytes": 2**29,
    }
    m = vs.LOOM_STEP.match(format_step(rec))
    assert m and int(m.group(1)) == 12 and float(m.group(3)) == 37.5
    # the trainer's line: step k/N, the time so far and left, the interval's mean loss
    m = vs.LOOM_STEP.match(format_step({**rec, "elapsed_s": 4.0, "loss_mean": 2.25}, total=300, eta_s=96))
    assert m and int(m.group(1)) == 12 and float(m.group(2)) == 2.25 and float(m.group(3)) == 37.5
    m = vs.LOOM_EVAL.match("step    250 | val loss 1.9876")
    assert m and m.group(m.lastindex) == "1.9876"
    m = vs.NANO_STEP.match("iter 7: loss 2.3408, time 44.92ms, mfu 0.03%")
    assert m and int(m.group(1)) == 7 and float(m.group(3)) == 44.92
    m = vs.NANO_EVAL.match("step 250: train loss 1.9000, val loss 2.0100")
    assert m and m.group(m.lastindex) == "2.0100"


def test_throughput_leaves_out_evals_pauses_and_warmup(vs):
    r = vs.Runner("x", [], Path("."), vs.NANO_STEP, vs.NANO_EVAL)
    t, steps = 0.0, []
    for s in range(1, 21):
        t += 5.0 if s in (10, 15) else 0.1  # step 10: an eval (every 10); step 15: a pause before it
        steps.append((s, t, 1 if s >= 15 else 0, 0.1))
    r.steps = steps
    out = vs.throughput(r, tokens_per_step=100, eval_every=10)
    # intervals into steps 4..20 (the first are warm-up), minus 9->10, 10->11, 19->20 (an eval at 10 and 20)
    # and 14->15 (a pause)
    assert out["steps_timed"] == 17 - 4
    assert out["tokens_per_s"] == pytest.approx(1000.0)


def test_report_names_every_run_and_the_seed_spread(vs, capsys):
    def rec(tps, val, t):
        return {
            "steps_timed": 90,
            "tokens_per_s": tps,
            "tokens_per_s_median_step": tps,
            "ms_per_step": 1.0,
            "ms_per_step_median": 1.0,
            "final_val_loss": val,
            "target": 2.0,
            "time_to_target_s": t,
            "step_at_target": 1500,
        }

    res = {
        "shape": "baby",
        "steps": 2000,
        "tokens_per_step": 768,
        "slice_s": 3.0,
        "wall_s": 200.0,
        "loom_args": ["--x"],
        "runners": ["nanoGPT", "loom", "loom seed=2"],
        "nanoGPT": rec(1000.0, 1.90, 80.0),
        "loom": rec(1500.0, 1.91, 50.0),
        "loom seed=2": rec(1490.0, 1.89, 51.0),
        "tokens_per_s_ratio": 1.5,
        "tokens_per_s_ratio_median_step": 1.5,
        "time_to_target_ratio": 1.6,
        "same_evaluator": {"windows": 10, "tokens": 640, "nanoGPT": 1.90, "loom": 1.92, "loom seed=2": 1.88},
    }
    vs.report(res)
    out = capsys.readouterr().out
    assert "loom seed=2" in out and "1.50x" in out and "1.60x" in out
    assert "spread (max - min over 2 seeds): 0.0400" in out and "loom mean - nanoGPT: +0.0000" in out
