"""train.time_budget_s (loom.train.budget): train.steps chosen from the measured step time.

Compared against: the arithmetic by hand (budget, mean of steps 2-10, the steps already taken), and a real
run whose config.toml and metrics end at the chosen step."""

from __future__ import annotations

import pytest
from loomrun import TINY

from loom.cli import main
from loom.config import Config, config_from_dict, load_toml
from loom.metrics import read_jsonl
from loom.train.budget import TimeBudget


def _budget(budget: float, steps: int = 1000, warmup: int = 100, start: int = 0):
    cfg = Config()
    cfg.train.time_budget_s, cfg.train.steps, cfg.optim.warmup_steps = budget, steps, warmup
    saved = []
    return cfg, TimeBudget(cfg, start, lambda v: v, lambda: saved.append(cfg.train.steps)), saved


def test_steps_follow_from_the_mean_step_time_after_the_first():
    cfg, b, saved = _budget(60.0)
    b.after_step(1, 30.0)  # the first step: compile and warm-up, left out
    for step in range(2, 11):
        b.after_step(step, 0.2)
    # 60 s - 11 steps' worth (the first counted as one) at 0.2 s = 57.8 s left: 289 more steps
    assert cfg.train.steps == 10 + 289 and saved == [299]
    b.after_step(11, 5.0)  # decided once
    assert cfg.train.steps == 299


@pytest.mark.parametrize(
    "budget, steps, warmup, start, want",
    [
        (1e6, 1000, 100, 0, 1000),  # never above train.steps
        (60.0, 1000, 100, 5, 1000),  # a resumed run keeps its steps
        (60.0, 8, 100, 0, 8),  # fewer steps than the probe
        (0.0, 1000, 100, 0, 1000),  # off
    ],
)
def test_what_the_budget_leaves_alone(budget, steps, warmup, start, want):
    cfg, b, _ = _budget(budget, steps, warmup, start)
    for step in range(start + 1, start + 12):
        b.after_step(step, 0.2)
    assert cfg.train.steps == want


def test_the_choice_falls_inside_a_short_warmup():
    cfg, b, _ = _budget(2.0, warmup=4)
    for step in range(1, 5):
        b.after_step(step, 0.1)
    assert cfg.train.steps == 4 + int((2.0 - 0.1 * 5) / 0.1)  # decided at step 4, the warm-up's last


def test_a_run_under_a_budget_records_the_steps_it_chose(char_data, tmp_path, capsys):
    args = ["train", f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=b", *TINY]
    assert main([*args, "--train.steps=100000", "--train.time_budget_s=2", "--train.eval_every=0"]) == 0
    run = tmp_path / "b"
    steps = config_from_dict(load_toml(run / "config.toml")).train.steps
    assert 10 <= steps < 100000
    assert max(r["step"] for r in read_jsonl(run / "metrics.jsonl") if "step" in r) == steps
    assert f"so {steps} steps instead of train.steps=100000" in capsys.readouterr().out
