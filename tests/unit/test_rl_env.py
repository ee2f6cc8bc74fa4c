"""Multi-turn RL episodes with an environment (rl.env, loom.rl.episode): the calculator environment against
hand-computed answers; the environment's tokens carry no loss (the loss and its gradient compared with those
tokens changed); `loom rl` end to end with the calculator and with a test environment of three turns
(rl/logprob_diff 0 in fp32 with observations in the sequence, an exact resume); each environment fault a counted
drop, never a crash; bad settings one clear error before any work."""

from __future__ import annotations

import json

import pytest
import torch
from envkit import OBS, env_args, make_calc_root

from loom.cli import main
from loom.errors import LoomError
from loom.rl import env as envlib
from loom.rl.envs import Calculator, evaluate
from loom.rl.episode import Episode, episode_batch
from loom.rl.loss import policy_loss


@pytest.fixture(scope="module")
def calc_root(tmp_path_factory):
    return make_calc_root(tmp_path_factory.mktemp("calc"))


def _records(run) -> list[dict]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss" in r]


# ------------------------------------------------------------------ the calculator
def test_calculator_answers_calls_and_scores_the_final_answer():
    c = Calculator()
    assert c.reset({"prompt": "123*45=", "answer": "5535"}) == ""
    assert c.step("<calc>123*45</calc>") == ("<result>5535</result>", 0.0, False)
    assert c.step("<calc>(7+5)*2-4</calc>") == ("<result>20</result>", 0.0, False)
    assert c.step("5535") == (None, 1.0, True)
    assert c.tool_errors == 0 and c.calls == 2
    d = Calculator()
    d.reset({"answer": "5535"})
    assert d.step("the answer is 5534") == (None, 0.0, True)


@pytest.mark.parametrize(
    "call",
    ["<calc></calc>", "<calc>12*</calc>", "<calc>__import__('os')</calc>", "<calc>1/0</calc>", "<calc>12*3"],
)
def test_a_malformed_tool_call_is_an_error_observation_counted_never_raised(call):
    c = Calculator()
    c.reset({"answer": "1"})
    assert c.step(call) == ("<result>error</result>", 0.0, False)
    assert c.tool_errors == 1


def test_evaluate_is_arithmetic_only():
    assert evaluate("999*99") == 98901 and evaluate("7/2") == 3.5 and evaluate("8/2") == 4
    assert evaluate("2**10") is None and evaluate("abs(1)") is None and evaluate("9" * 13) is None


# ------------------------------------------------------------------ the environment's calls
class _Env:
    def __init__(self, step_out=None, raises=False, hang=0.0):
        self.out, self.raises, self.hang = step_out, raises, hang

    def reset(self, row):
        return ""

    def step(self, text):
        if self.raises:
            raise ValueError("boom")
        if self.hang:
            import time

            time.sleep(self.hang)
        return self.out


@pytest.mark.parametrize(
    "env, message",
    [
        (_Env(raises=True), "raised ValueError: boom"),
        (_Env(("x", 0.0, False), hang=5.0), "ran past rl.env_timeout_s=0.2s"),
        (_Env((7, 0.0, False)), "not a string or None"),
        (_Env(("x", float("nan"), False)), "not a finite number"),
        (_Env(("x", 0.0)), "not (observation, reward, done)"),
    ],
)
def test_an_environment_fault_is_an_env_fault(env, message):
    with pytest.raises(envlib.EnvFault, match=message.replace("(", r"\(").replace(")", r"\)")):
        envlib.step(env, "text", 0.2)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_env_module:Env", "does not import"),
        ("loom.rl.envs:NoSuchClass", "has no class 'NoSuchClass'"),
        ("loom.rl.envs:evaluate", "has no class 'evaluate'"),
        ("loom.errors:LoomError", "no reset or step method"),
    ],
)
def test_load_env_refuses_what_is_not_an_environment(spec, message):
    with pytest.raises(LoomError, match=message):
        envlib.load_env(spec)


def test_a_built_in_environment_is_taken_by_its_short_name():
    assert envlib.load_env("calculator") is Calculator is envlib.load_env("loom.rl.envs:Calculator")


# ------------------------------------------------------------------ the loss
def _episode(obs: list[int]) -> Episode:
    """A prompt of 3 tokens, a model turn of 3, an observation, a model turn of 2."""
    ep = Episode([1, 2, 3], 3)
    ep.add([4, 5, 6], [-0.5, -0.25, -1.0])
    ep.add(obs)
    ep.add([7, 8], [-0.75, -0.125])
    return ep


def test_environment_tokens_carry_no_loss():
    """The same logits, the batch of an episode and of the same episode with other observation tokens: the loss
    and its gradient are equal (the environment's tokens are never targets), and the gradient is 0 at every
    position whose next token is the environment's. It fails if an observation's tokens are trained on."""
    a, b = _episode([9, 10, 11, 12]), _episode([13, 14, 15, 16])
    batches = [episode_batch([e], [1.5], [True], 0, 1) for e in (a, b)]
    torch.manual_seed(0)
    logits = torch.randn(1, batches[0].x.size(1), 20)
    losses, grads = [], []
    for batch in batches:
        lg = logits.clone().requires_grad_(True)
        loss, stats = policy_loss(lg, batch.y, batch.adv, batch.old_lp, (0.2, 0.28), sampler_lp=None)
        loss.backward()
        losses.append(loss.detach())
        grads.append(lg.grad)
        assert int(stats["targets"]) == 5  # the model's 3 + 2 tokens, not the observation's 4
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    y = batches[0].y[0].tolist()
    assert y == [-1, -1, 4, 5, 6, -1, -1, -1, -1, 7, 8]
    env_pos = [i for i, t in enumerate(y) if t == -1 and i >= 5]
    assert all(float(grads[0][0, i].abs().sum()) == 0.0 for i in env_pos)
    assert batches[0].old_lp[0, 2:5].tolist() == [-0.5, -0.25, -1.0]


# ------------------------------------------------------------------ loom rl end to end
def test_loom_rl_with_the_calculator_runs_and_records_episodes(calc_root, capsys):
    held = f"--rl.eval_prompts={calc_root / 'calc' / 'rl_heldout.jsonl'}"
    assert main(env_args(calc_root, "calc", "--train.steps=2", held, "--rl.eval_k=2")) == 0
    recs = _records(calc_root / "runs" / "calc")
    assert len(recs) == 2
    for r in recs:
        assert r["rl/turns"] >= 1.0 and "rl/env_dropped" in r and "rl/tool_errors" in r
        assert r["rl/logprob_diff"] == 0.0
    allrecs = (calc_root / "runs" / "calc" / "metrics.jsonl").read_text()
    assert '"rl/pass@1"' in allrecs


def test_multi_turn_episodes_train_on_the_models_tokens_with_logprob_diff_0(calc_root):
    """Three model turns and two observations an episode (envkit.Turns): the sampler's log-probabilities of the
    second and third turns (their context prefilled again, observations included) equal the trainer's bit for
    bit, and only the model's tokens are trained."""
    assert main(env_args(calc_root, "turns", "--rl.env=envkit:Turns", "--train.steps=3")) == 0
    recs = _records(calc_root / "runs" / "turns")
    assert [r["rl/turns"] for r in recs] == [3.0] * 3
    assert [r["rl/logprob_diff"] for r in recs] == [0.0] * 3
    assert [r["rl/env_dropped"] for r in recs] == [0] * 3
    assert sum(r["rl/trained_tokens"] for r in recs) > 0


@pytest.mark.parametrize(
    "env, extra, check",
    [
        ("RaisesOnEven", [], lambda r: 0 < r["rl/env_dropped"]),
        ("HangsOnEven", ["--rl.env_timeout_s=0.3"], lambda r: 0 < r["rl/env_dropped"]),
        ("NonString", [], lambda r: r["rl/env_dropped"] == 8),
        ("NeverEnds", [], lambda r: r["rl/env_dropped"] == 8 and r["rl/turns"] == 3.0),
        ("MalformedCall", [], lambda r: r["rl/tool_errors"] == 8 and r["rl/env_dropped"] == 0),
    ],
)
def test_an_environment_fault_drops_its_episode_counted_never_a_crash(calc_root, env, extra, check):
    assert main(env_args(calc_root, f"bad-{env}", f"--rl.env=envkit:{env}", "--train.steps=2", *extra)) == 0
    recs = _records(calc_root / "runs" / f"bad-{env}")
    assert len(recs) == 2 and any(check(r) for r in recs), recs


def test_a_token_budget_too_small_for_the_episode_drops_it(calc_root):
    budget = [
        "--rl.env=envkit:NeverEnds",
        "--rl.max_turns=50",
        "--rl.max_episode_tokens=12",
        "--train.steps=1",
    ]
    assert main(env_args(calc_root, "budget", *budget)) == 0
    (rec,) = _records(calc_root / "runs" / "budget")
    assert rec["rl/env_dropped"] == 8 and rec["rl/trained_tokens"] == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.max_turns=0"], "rl.max_turns=0: an episode needs at least one model turn"),
        (["--rl.env=no_such_env_module:Env"], "module 'no_such_env_module' does not import"),
        (["--rl.env=loom.rl.envs:Nope"], "has no class 'Nope'"),
        (["--rl.env=Calculator"], "is not module:Class"),
        (["--rl.max_episode_tokens=4"], "less than one turn's rl.max_new_tokens=12"),
    ],
)
def test_bad_env_settings_are_one_clear_error_before_any_work(calc_root, extra, message, capsys):
    assert main(env_args(calc_root, "badenv", *extra, "--train.steps=1")) == 2
    err = capsys.readouterr().err
    assert "loom: error:" in err and message in err and "Traceback" not in err, err
    assert not (calc_root / "runs" / "badenv" / "metrics.jsonl").exists()


def test_a_multi_turn_run_resumes_exactly(calc_root):
    """A run of 2 steps continued to 4 against one of 4 (constant rate): the episodes follow from the rollout
    count, so the rewards, turns and losses after the resume are the uninterrupted run's."""
    flat = ["--rl.env=envkit:Turns", "--optim.min_lr=1e-3", "--train.ckpt_every=2"]
    assert main(env_args(calc_root, "whole", *flat, "--train.steps=4")) == 0
    assert main(env_args(calc_root, "cut", *flat, "--train.steps=2")) == 0
    assert main([*env_args(calc_root, "cut", *flat, "--train.steps=4"), "--resume"]) == 0
    whole, cut = _records(calc_root / "runs" / "whole"), _records(calc_root / "runs" / "cut")
    keys = ("loss", "grad_norm", "rl/reward_mean", "rl/response_len", "rl/turns")
    assert any(r["grad_norm"] > 0 for r in whole[2:])
    assert [[r[k] for k in keys] for r in whole[2:]] == [[r[k] for k in keys] for r in cut[-2:]]


def test_observation_constant_is_in_the_base_vocabulary(calc_root):
    """The test environments' observations are written in the base run's characters (else every episode drops)."""
    text = (calc_root / "calc" / "base.txt").read_text()
    assert OBS in text and "<result>error</result>" in text
