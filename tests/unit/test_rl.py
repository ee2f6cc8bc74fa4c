"""`loom rl` end to end on one process (full and LoRA), the sampler's log-probabilities against the trainer's,
exact resume, and RL's bad inputs.

Compared against: the trainer's own forward (the log-probability of each sampled token from a training forward
of the whole sequences, fp32), an uninterrupted run (a run stopped and resumed gives the same rewards and
losses), and the contract for bad input (a LoomError that names the cause, before any step)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from rlkit import rl_args

from loom.cli import main
from loom.errors import LoomError

REGEX = ["--rl.reward=regex", "--rl.pattern=1"]  # an answer holding a 1: rewards that vary inside a group


def _records(run_dir) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "step" in r:
            out.append(r)
    return out


def _heldout(run_dir) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "rl/pass@1" in r]


def test_rl_trains_and_records_its_figures(rl_root):
    held = f"--rl.eval_prompts={rl_root / 'arith' / 'rl_heldout.jsonl'}"
    args = rl_args(rl_root, "full", *REGEX, "--train.steps=3", held, "--rl.eval_k=2", "--rl.eval_every=2")
    assert main(args) == 0
    recs = _records(rl_root / "runs" / "full")
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        for key in (
            "rl/reward_mean",
            "rl/reward_std",
            "rl/response_len",
            "rl/entropy",
            "rl/clip_frac",
            "rl/dropped_groups",
            "rl/logprob_diff",
            "rl/rollout_tokens_per_s",
            "rl/train_tokens_per_s",
        ):
            assert key in r, key
        assert 0 <= r["rl/reward_mean"] <= 1 and r["rl/response_len"] <= 5  # 4 tokens + the end of turn
        assert r["rl/logprob_diff"] < 1e-5  # fp32: the sampler's and the trainer's log-probabilities
    assert any(r["rl/trained_tokens"] > 0 and r["grad_norm"] > 0 for r in recs)
    held_recs = _heldout(rl_root / "runs" / "full")
    assert [r["step"] for r in held_recs] == [2, 3]
    assert all(0 <= r["rl/pass@1"] <= r["rl/pass@2"] + 1 for r in held_recs)


def test_rl_with_lora_kl_and_several_updates_per_batch(rl_root):
    extra = ["--finetune.lora_rank=4", "--rl.kl_coef=0.1", "--rl.updates_per_batch=2", "--train.steps=4"]
    assert main(rl_args(rl_root, "lora", *REGEX, *extra)) == 0
    recs = _records(rl_root / "runs" / "lora")
    assert "rl/kl" in recs[0] and recs[0]["rl/kl"] == 0  # the first step's policy is the reference
    # a rollout every second step: its figures on steps 1 and 3; steps 2 and 4 reuse the batch (the ratio)
    assert ["rl/reward_mean" in r for r in recs] == [True, False, True, False]
    assert recs[1]["rl/kl"] >= 0


def test_engine_logprobs_match_the_training_forward(rl_root):
    """The log-probability the engine reports for each sampled token against a training forward (fp32, CPU)
    of the whole sampled sequences, as the RL loss computes it: bit for bit under batch-invariant forwards
    (loom.model.batch_invariant; without them the CPU's kernels, which choose their paths by the number of
    rows and the sequence length, leave ~1e-7 to 1e-5, recorded each step as rl/logprob_diff)."""
    from loom.config import config_from_dict, load_toml
    from loom.data.loader import read_meta
    from loom.model.batch_invariant import batch_invariant
    from loom.model.registry import spec_of
    from loom.rl.prompts import load_prompts, rl_template
    from loom.rl.rollout import build_batch, sample
    from loom.runs import pretrained_state

    cfg = config_from_dict(load_toml(rl_root / "runs" / "full" / "config.toml"))
    meta = read_meta(rl_root / "chat")
    model = spec_of(cfg).build_model(cfg, meta["vocab_size"], "cpu")
    model.load_state_dict(pretrained_state(cfg, model), strict=False)
    template = rl_template(rl_root / "chat", meta)
    prompts = load_prompts(rl_root / "arith" / "rl_train.jsonl", "answer", template, 28)
    seeds = [[10 * i + g for g in range(4)] for i in range(6)]
    reqs = sample(model, prompts.ids[:6], seeds, 4, template.stop_ids, meta["vocab_size"], batch_invariant)
    b = build_batch(reqs, [1.0] * len(reqs), [True] * len(reqs), template.eot_id)
    with torch.no_grad(), batch_invariant():  # as loom rl runs both (rl.batch_invariant, on by default)
        logp = F.log_softmax(model(b.x).float(), -1)
    mask = b.y != -1
    lp = logp.gather(-1, b.y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert int(mask.sum()) == sum(len(r.tokens) + (r.stop_token is not None) for r in reqs) > 0
    assert torch.equal(lp[mask], b.old_lp[mask])  # bit for bit


def test_resume_gives_the_rewards_and_losses_of_an_uninterrupted_run(rl_root):
    """A run of 2 steps continued to 4 (a constant learning rate: the schedule does not depend on train.steps)
    against one of 4; the kill -9 form is tests/faults/test_rl_kill_resume.py."""
    flat = [*REGEX, "--optim.min_lr=1e-3", "--train.ckpt_every=2"]
    assert main(rl_args(rl_root, "whole", *flat, "--train.steps=4")) == 0
    assert main(rl_args(rl_root, "cut", *flat, "--train.steps=2")) == 0
    assert main([*rl_args(rl_root, "cut", *flat, "--train.steps=4"), "--resume"]) == 0
    whole, cut = _records(rl_root / "runs" / "whole"), _records(rl_root / "runs" / "cut")
    keys = ("loss", "grad_norm", "rl/reward_mean", "rl/response_len", "rl/entropy")
    assert any(r["grad_norm"] > 0 for r in whole[2:])
    assert [[r[k] for k in keys] for r in whole[2:]] == [[r[k] for k in keys] for r in cut[-2:]]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.group_size=1"], "a group of one"),
        (["--train.batch_size=6"], "whole groups"),
        (["--rl.answer_field=solution"], "lack the field 'solution'"),
        (["--rl.max_new_tokens=31"], "every prompt is longer"),
        (["--rl.reward=no_such_reward_module:score"], "does not import"),
    ],
)
def test_bad_rl_input_is_a_clear_error(rl_root, extra, message, capsys):
    assert main(rl_args(rl_root, "bad", *extra, "--train.steps=1")) == 2
    err = capsys.readouterr().err
    assert "loom: error:" in err and message in err and "Traceback" not in err, err
    assert not (rl_root / "runs" / "bad" / "metrics.jsonl").exists()  # refused before any step


def test_rl_refuses_a_base_run_and_missing_prompts(rl_root, capsys):
    args = rl_args(rl_root, "bad2", "--train.steps=1")
    assert (
        main([a if not a.startswith("--data.path=") else f"--data.path={rl_root / 'text'}" for a in args])
        == 2
    )
    assert "needs conversation data" in capsys.readouterr().err
    assert main([a for a in args if not a.startswith("--rl.prompts=")]) == 2
    assert "rl.prompts is not set" in capsys.readouterr().err
    # a base run's data reached without the verb's check (loom train with rl.prompts): the stage refuses it
    from loom.data.loader import read_meta
    from loom.rl.prompts import rl_template

    with pytest.raises(LoomError, match="not chat data"):
        rl_template(rl_root / "text", read_meta(rl_root / "text"))


def test_a_failing_reward_is_a_counted_skip_and_an_error_when_every_sample_fails(
    rl_root, tmp_path, monkeypatch, capsys
):
    (tmp_path / "flaky_rewards.py").write_text(
        "def half(s):\n    if s.text.startswith('1'):\n        raise ValueError('no')\n    return float('2' in s.text)\n"
        "def never(s):\n    return float('nan')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(rl_args(rl_root, "flaky", "--rl.reward=flaky_rewards:half", "--train.steps=2")) == 0
    recs = _records(rl_root / "runs" / "flaky")
    assert (
        sum(r["rl/reward_errors"] for r in recs) > 0
    )  # answers starting with 1: counted, their groups dropped
    assert all(r["rl/error_groups"] <= 2 for r in recs)
    assert main(rl_args(rl_root, "never", "--rl.reward=flaky_rewards:never", "--train.steps=1")) == 2
    assert "failed on every sample" in capsys.readouterr().err


@pytest.mark.parametrize("keys", [{"pp": 2}, {"cp": 2}, {"dp_impl": "mpi"}, {"tp": 2, "sp": True}])
def test_rl_layouts_that_split_an_answer_are_refused(keys):
    from loom.config import config_from_dict, validate

    cfg = config_from_dict(
        {
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
            "train": {"batch_size": 8},
            "rl": {"prompts": "p.jsonl", "group_size": 4},
            "parallel": keys,
        }
    )
    why = "decodes one token" if "sp" in keys else "a whole answer per rank"
    with pytest.raises(LoomError, match=why):
        validate(cfg, world=2)


def test_plot_draws_the_rl_panels(rl_root, tmp_path):
    from loom.plot import plot_runs

    run = rl_root / "runs" / "full"
    if not (run / "metrics.jsonl").exists():
        assert main(rl_args(rl_root, "full", *REGEX, "--train.steps=2")) == 0
    out = plot_runs([run], tmp_path / "rl.png")
    assert out.stat().st_size > 10_000


def test_the_batch_holds_trained_rows_and_fills_each_micro_batch():
    """A dropped group's rows have no targets: the batch leaves them out, except as many as make the row count
    a multiple of the gradient accumulation steps (every micro-batch gets its share)."""
    from loom.engine import Request, SamplingParams
    from loom.rl.rollout import build_batch

    reqs = []
    for j in range(8):
        r = Request([1, 2, 3], SamplingParams(max_tokens=4, logprobs=True))
        r.tokens, r.logprobs = [4 + j, 5], [-0.5, -0.25]
        reqs.append(r)
    trained = [True] * 3 + [False] * 5
    b = build_batch(reqs, [1.0] * 8, trained, 0)
    assert b.x.shape == (3, 4) and b.x[:, 3].tolist() == [4, 5, 6]
    b = build_batch(reqs, [1.0] * 8, trained, 0, accum=2)
    assert b.x.shape[0] == 4 and (b.y[3] == -1).all() and (b.y[:3] != -1).sum() == 6
    b = build_batch(reqs, [0.0] * 8, [False] * 8, 0, accum=4)  # every group dropped: one row per micro-batch
    assert b.x.shape[0] == 4 and (b.y == -1).all()
    b = build_batch(reqs, [float(j) for j in range(8)], [True] * 8, 0)  # targets after the prompt, at its end
    assert b.y[:, 2:].tolist() == [[4 + j, 5] for j in range(8)] and (b.y[:, :2] == -1).all()
    assert b.adv.tolist() == [[0.0, 0.0, float(j), float(j)] for j in range(8)]
    assert b.old_lp.tolist() == [[0.0, 0.0, -0.5, -0.25]] * 8


def test_a_bad_rl_step_is_skipped_and_names_its_prompts(rl_root, monkeypatch):
    """A NaN gradient at step 2 (LOOM_FAULT_NAN_STEPS): the step is skipped and its record says which rollout and
    which rl.prompts rows it trained on (RL's batches are rollouts, not rows of a token file); the run goes on."""
    monkeypatch.setenv("LOOM_FAULT_NAN_STEPS", "2")
    assert main(rl_args(rl_root, "nan", *REGEX, "--train.steps=3")) == 0
    bad = [r for r in _records(rl_root / "runs" / "nan") if r.get("skipped")]
    assert [r["step"] for r in bad] == [2]
    assert bad[0]["rollout"] == 2 and len(bad[0]["prompts"]) == 2
    assert all(0 <= i < 200 for i in bad[0]["prompts"])
