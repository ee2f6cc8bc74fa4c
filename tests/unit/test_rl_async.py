"""Asynchronous rollouts (rl.max_staleness, loom.rl.async_rollout), against the synchronous loop: the same `loom rl`
command with rl.max_staleness=0 (the loop as it was), bit for bit; the rollout worker run at lag 0 (its schedule
patched to sample with the current weights) equals it bit for bit too, and holds the trainer's weights exactly at
every rollout; with K > 0 each step records its staleness and the truncated importance weights' figures."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
from rlkit import rl_args

from loom.cli import main
from loom.config import config_from_dict, validate
from loom.errors import LoomError
from loom.rl import async_rollout
from loom.runs import load_run

# what two runs that train alike record alike (times are the machine's)
KEYS = ("loss", "grad_norm", "rl/reward_mean", "rl/response_len", "rl/entropy", "rl/logprob_diff")
REGEX = ["--rl.reward=regex", "--rl.pattern=1"]  # a reward the tiny model's answers differ on


def _steps(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").open()) if "loss" in r and "step" in r]


def _params(run) -> dict[str, torch.Tensor]:
    _, model, *_ = load_run(run, torch.device("cpu"), merge=False)
    return model.state_dict()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _run(rl_root, name: str, *extra: str) -> list[dict]:
    assert main(rl_args(rl_root, name, *REGEX, "--train.steps=3", *extra)) == 0
    assert not multiprocessing.active_children()  # the rollout worker, if any, has stopped
    return _steps(rl_root / "runs" / name)


@pytest.fixture(scope="module")
def sync_run(rl_root):
    return _run(rl_root, "async-sync")


def test_k0_is_the_synchronous_loop(rl_root, sync_run):
    k0 = _run(rl_root, "async-k0", "--rl.max_staleness=0")
    assert [[r[k] for k in KEYS] for r in k0] == [[r[k] for k in KEYS] for r in sync_run]
    assert not any("rl/staleness" in r for r in k0)  # no worker: the step samples
    assert _same(_params(rl_root / "runs" / "async-k0"), _params(rl_root / "runs" / "async-sync"))


def test_the_worker_at_lag_0_equals_the_synchronous_loop_and_holds_the_trainers_weights(
    rl_root, sync_run, monkeypatch
):
    """The worker's path (its own process, model and engine; weights pushed over its group; answers sent back)
    with the schedule at lag 0: the same answers, log-probabilities, losses and weights as sampling in the step.
    At each rollout the worker's weights are the trainer's, compared bit for bit."""
    monkeypatch.setattr(async_rollout, "version_of", lambda r, k, K: r * k)
    checked = []
    take = async_rollout.AsyncRollouts.take

    def take_and_check(self, r):
        reqs = take(self, r)
        self.conn.send(("state",))  # the worker's model state now
        theirs = self._expect("state")
        checked.append(_same(theirs, {n: t.detach() for n, t in self.sender.state.items()}))
        return reqs

    monkeypatch.setattr(async_rollout.AsyncRollouts, "take", take_and_check)
    lag0 = _run(rl_root, "async-lag0", "--rl.max_staleness=1")
    assert checked == [True, True, True]
    assert [[r[k] for k in KEYS] for r in lag0] == [[r[k] for k in KEYS] for r in sync_run]
    assert all(r["rl/staleness"] == 0 and r["rl/is_weight_max"] == 1.0 for r in lag0)
    assert all(r["rl/logprob_diff"] == 0 for r in lag0)
    assert any(r["grad_norm"] > 0 for r in lag0)
    assert _same(_params(rl_root / "runs" / "async-lag0"), _params(rl_root / "runs" / "async-sync"))


@pytest.mark.parametrize("K, lags", [(1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])])
def test_k_trains_on_older_weights_and_records_the_lag_and_the_weights(rl_root, K, lags):
    """Rollout r is sampled with the weights of step max(0, r - K): the step's staleness is min(r, K); the
    sampler's log-probabilities then differ from the trainer's, and rl.is_cap's weights are recorded."""
    name = f"async-k{K}"
    assert main(rl_args(rl_root, name, *REGEX, "--train.steps=4", f"--rl.max_staleness={K}")) == 0
    assert not multiprocessing.active_children()
    recs = _steps(rl_root / "runs" / name)
    assert [r["rl/staleness"] for r in recs] == lags
    for r in recs:
        assert 0 < r["rl/is_weight_mean"] <= 2.0 and r["rl/is_weight_max"] > 0
        assert 0 <= r["rl/is_truncated_frac"] <= 1 and r["rl/rollout_wait_s"] >= 0
    assert any(r["grad_norm"] > 0 for r in recs)
    assert any(r["rl/logprob_diff"] > 0 for r in recs[1:])  # older weights sampled them


def _cfg(**sections) -> object:
    d = {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
        "train": {"batch_size": 8},
        "rl": {"prompts": "p.jsonl", "group_size": 4, "max_new_tokens": 4, "max_staleness": 1},
    }
    for name, keys in sections.items():
        d.setdefault(name, {}).update(keys)
    return config_from_dict(d)


@pytest.mark.parametrize(
    "sections, world, message",
    [
        ({"rl": {"max_staleness": -1}}, 1, "rl.max_staleness"),
        ({"rl": {"is_cap": 0}}, 1, "rl.is_cap=0 turns off"),
        ({"parallel": {"tp": 2}}, 2, "holds pieces of them"),
        ({"parallel": {"dp_impl": "ddp"}}, 2, "2 data-parallel ranks"),
        ({"parallel": {"dp_impl": "fsdp"}}, 2, "2 data-parallel ranks"),
        ({"finetune": {"lora_rank": 4, "quantize_base": "nf4"}}, 1, "holds pieces of them"),
        ({"rl": {"env": "loom.rl.envs:Calculator"}}, 1, "multi-turn episodes run in the trainer"),
    ],
)
def test_settings_asynchronous_rollouts_cannot_serve_are_refused(sections, world, message):
    with pytest.raises(LoomError, match=message):
        validate(_cfg(**sections), world=world)


@pytest.mark.parametrize("extra, message", [(["--rl.max_staleness=-1"], "rl.max_staleness")])
def test_bad_max_staleness_is_a_clear_error_before_any_work(rl_root, extra, message, capsys):
    assert main(rl_args(rl_root, "async-bad", *extra, "--train.steps=1")) == 2
    err = capsys.readouterr().err
    assert "loom: error:" in err and message in err and "Traceback" not in err, err
    assert not (rl_root / "runs" / "async-bad" / "metrics.jsonl").exists()
