"""`loom rl` with an environment (rl.env, multi-turn episodes) on real processes (gloo, loopback): `loom verify` on
an RL config with three turns an episode (tests/envkit.py's Turns), ddp and fsdp at 2 processes against one
process: losses and parameters within 1e-5 (fp32), the same rewards and turns, and rl/logprob_diff 0 at every
step on every layout (under fsdp the ranks agree before each turn whether any episode is live, so their sharded
forwards pair up)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from envkit import MODEL, make_calc_root
from loomrun import verify_records

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def calc_root(tmp_path_factory):
    return make_calc_root(tmp_path_factory.mktemp("calc"))


def _config(root: Path, path: Path) -> None:
    keys = dict(a.removeprefix("--").split("=", 1) for a in MODEL)
    lines = ["[model]", *(f"{k.split('.')[1]} = {v}" for k, v in keys.items())]
    lines += [
        f'init_from = "run:{root / "runs" / "sft"}"',
        "[train]",
        "batch_size = 8",
        "[optim]",
        "lr = 1e-3",
    ]
    lines += ["warmup_steps = 0", "[rl]", f'prompts = "{root / "calc" / "rl_train.jsonl"}"', "group_size = 4"]
    lines += ["max_new_tokens = 12", 'env = "envkit:Turns"', "max_turns = 3", "max_dropped_steps = 0"]
    path.write_text("\n".join(lines) + "\n")


def _by_step(run: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r and "step" in r]


def test_verify_rl_env_on_ddp_and_fsdp_against_one_process(calc_root, tmp_path, monkeypatch):
    # the workers import the test environment (envkit) by name, as a user's module:Class is imported
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    )
    cfg = tmp_path / "rl.toml"
    _config(calc_root, cfg)
    layouts = "ddp,fsdp"
    recs = verify_records(
        tmp_path, calc_root / "chat", layouts, "--nproc", "2", "--tol-loss", "1e-5", str(cfg), steps=6
    )
    assert [r["world_size"] for r in recs] == [2, 2]
    ref = _by_step(tmp_path / "v" / "reference")
    assert sum(r["rl/trained_tokens"] for r in ref) > 0 and all(r["rl/turns"] == 3.0 for r in ref)
    for name in layouts.split(","):
        run = _by_step(tmp_path / "v" / name)
        for key in ("rl/reward_mean", "rl/trained_tokens", "rl/turns", "rl/env_dropped"):
            assert [r[key] for r in run] == [r[key] for r in ref], (name, key)
        assert [r["rl/logprob_diff"] for r in run] == [0.0] * len(run), name
    assert [r["rl/logprob_diff"] for r in ref] == [0.0] * len(ref)
