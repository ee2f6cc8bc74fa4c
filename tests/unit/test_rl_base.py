"""`loom rl` from a base model (R1-Zero style: raw-text prompts through the base run's own tokenizer, answers ended
by rl.stop or end-of-text, a format reward plus a correctness reward), its bad inputs, and the truncated
importance correction (rl.is_cap) where batch-invariance is off.

Compared against: the rewards' and the loss's closed forms written out here, the sampler's own log-probabilities
(rl/logprob_diff 0 under batch-invariant forwards), an uninterrupted run (resume), and the contract for bad
input (a LoomError that names the cause, before any step)."""

from __future__ import annotations

import json

import pytest
import torch
from rlkit import rl_base_args

from loom.cli import main
from loom.errors import LoomError


def _records(run_dir) -> list[dict]:
    return [
        r
        for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
        if "step" in r and ("loss" in r or "rl/pass@1" in r)
    ]


def test_base_model_rl_trains_on_raw_prompts_with_format_and_correctness_rewards(rl_root):
    held = f"--rl.eval_prompts={rl_root / 'arith' / 'rl_heldout.jsonl'}"
    assert main(rl_base_args(rl_root, "base-rl", "--train.steps=3", held, "--rl.eval_k=2")) == 0
    recs = _records(rl_root / "runs" / "base-rl")
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["step"] for r in recs if "rl/pass@1" in r] == [0, 3]  # the base model's baseline, then the end
    for r in steps:
        assert r["rl/logprob_diff"] == 0.0  # the sampler's log-probabilities are the trainer's
        assert r["rl/response_len"] <= 4
        # 0.2 * format (digits only) + exact: a sum of the two, never anything else
        for v in (r["rl/reward_min"], r["rl/reward_max"]):
            assert min(abs(v - x) for x in (0.0, 0.2, 1.0, 1.2)) < 1e-9, v
    assert "rl/is_weight_mean" not in steps[0]  # batch-invariant on a CPU: nothing to correct


def test_base_prompts_are_raw_text_and_answers_end_at_the_stop_text(rl_root):
    """The prompt ids are the tokenizer's ids of the row's text (no chat tokens); sampling with rl.stop ends each
    answer at its first newline, which is the answer's last token (it trains), and the reward's text is cut
    before it."""
    from loom.data.loader import read_meta
    from loom.rl.prompts import TextTemplate, load_prompts, rl_template
    from loom.rl.rollout import answer_text, sample
    from loom.runs import load_run

    meta = read_meta(rl_root / "text")
    template = rl_template(rl_root / "text", meta)
    assert isinstance(template, TextTemplate) and template.stop_ids == (template.tok.eot_id,)
    prompts = load_prompts(rl_root / "arith" / "rl_train.jsonl", "answer", template, 32, 8)
    assert prompts.ids[0] == template.tok.encode(prompts.rows[0]["prompt"])
    model = load_run(rl_root / "runs" / "base", torch.device("cpu"))[1]
    reqs = sample(model, prompts.ids[:4], [[1, 2, 3]] * 4, 8, template.stop_ids, meta["vocab_size"])
    stopped = sample(
        model,
        prompts.ids[:4],
        [[1, 2, 3]] * 4,
        8,
        template.stop_ids,
        meta["vocab_size"],
        stops=("\n",),
        decode=template.tok.decode,
    )
    ended = 0
    for free, r in zip(reqs, stopped, strict=True):
        text = template.tok.decode(r.tokens)
        if "\n" in text:
            ended += 1
            assert text.index("\n") == len(text) - 1  # the newline ends it: nothing sampled after
            assert r.tokens == free.tokens[: len(r.tokens)]  # the same draws up to there
        assert "\n" not in answer_text(template.tok, r, ("\n",))
    assert ended > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rl.stop=é"], "rl.stop 'é' can never match"),
        (["--rl.stop=\\n,"], "holds an empty text"),
        (["--rl.reward=0.2*regex+x*exact"], "is not [WEIGHT*]REWARD"),
    ],
)
def test_bad_base_rl_settings_are_clear_errors_before_any_step(rl_root, extra, message, capsys):
    assert main(rl_base_args(rl_root, "bad-base", *extra, "--train.steps=1")) == 2
    err = capsys.readouterr().err
    assert "loom: error:" in err and message in err and "Traceback" not in err, err
    assert not (rl_root / "runs" / "bad-base" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "12×3=", "answer": "36"}, "cannot encode this prompt: character '×'"),
        ({"messages": [{"role": "user", "content": "1+2="}], "answer": "3"}, "takes plain prompts"),
    ],
)
def test_a_base_prompt_its_tokenizer_cannot_encode_is_refused_with_its_line(
    rl_root, tmp_path, row, message, capsys
):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n" + json.dumps(row) + "\n")
    assert main([*rl_base_args(rl_root, "bad-enc", "--train.steps=1"), f"--rl.prompts={path}"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2" in err and message in err, err
    assert not (rl_root / "runs" / "bad-enc" / "metrics.jsonl").exists()


def test_stop_texts_parse_with_escapes():
    from loom.rl.prompts import parse_stops

    assert parse_stops("") == ()
    assert parse_stops("\\n") == ("\n",)
    assert parse_stops("\\n\\n,</answer>,a\\,b") == ("\n\n", "</answer>", "a,b")
    with pytest.raises(LoomError, match="empty text"):
        parse_stops(",x")


def test_a_sum_of_rewards_adds_its_terms_and_is_correct_only_when_every_term_is():
    from loom.rl.rewards import SumReward, load_reward

    r = load_reward("0.2*regex+exact", "answer", r"^\d+$")
    assert isinstance(r, SumReward) and r.field == "answer"
    row = {"answer": "46"}
    assert r.score(row, "46")[0] == pytest.approx(1.2)
    assert r.score(row, "47")[0] == pytest.approx(0.2)
    assert r.score(row, "x")[0] == 0.0
    assert r.correct(row, "46") and not r.correct(row, "47")
    assert load_reward("exact", "answer").correct(row, "46")


def test_the_truncated_importance_correction_equals_its_closed_form():
    """policy_loss with rl.is_cap against the formula: per token -w * min(r A, clip(r) A), r = exp(lp - old),
    w = min(exp(old - sampler), cap), constant; the gradient of the first step (old = this forward's own) is
    -w * A * dlp; the statistics are the weights' sum, the count truncated and the largest raw weight."""
    from loom.rl.loss import policy_loss, target_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, requires_grad=True)
    y = torch.randint(0, 7, (2, 5), generator=g)
    y[0, :2] = -1
    y[1, 4] = -1
    adv = torch.randn(2, 5, generator=g)
    lp0 = target_logprobs(logits.detach(), y)[0]
    sampler = lp0 + torch.tensor(
        [[0.0, 0.0, 0.9, -0.3, 0.05], [1.2, -0.7, 0.01, 0.3, 0.0]]
    )  # some past cap 2
    cap, clip = 2.0, (0.2, 0.28)

    # the first step: old_lp None (the trainer's own forward), the ratio exactly 1
    loss, stats = policy_loss(logits, y, adv, None, clip, sampler_lp=sampler, is_cap=cap)
    m = (y != -1).float()
    w = torch.exp(lp0 - sampler).clamp(max=cap)
    assert torch.allclose(loss, -(w * adv * m).sum())
    loss.backward()
    ref = logits.detach().clone().requires_grad_(True)
    (-(w * adv * target_logprobs(ref, y)[0] * m).sum()).backward()
    assert torch.allclose(logits.grad, ref.grad, atol=1e-6)
    raw = torch.exp(lp0 - sampler)
    assert torch.allclose(stats["is_weight"], (w * m).sum())
    assert stats["is_truncated"] == ((raw > cap).float() * m).sum() > 0
    assert torch.allclose(stats["is_max"], (raw * m).max())
    assert torch.equal(stats["old_lp"], lp0)
    assert torch.allclose(stats["logprob_diff"], ((lp0 - sampler).abs() * m).max())

    # a later step: old is the first step's, the policy has moved; PPO's clip on r, the same weights
    moved = (logits.detach() + 0.3 * torch.randn(2, 5, 7, generator=g)).requires_grad_(True)
    loss2, _ = policy_loss(moved, y, adv, lp0, clip, sampler_lp=sampler, is_cap=cap)
    lp1 = target_logprobs(moved.detach(), y)[0]
    r = torch.exp(lp1 - lp0)
    want = -(w * torch.minimum(r * adv, r.clamp(0.8, 1.28) * adv) * m).sum()
    assert torch.allclose(loss2, want)
    # is_cap 0 (or no sampler_lp): no weight, the plain surrogate
    loss3, stats3 = policy_loss(moved, y, adv, lp0, clip, sampler_lp=sampler, is_cap=0.0)
    assert torch.allclose(loss3, -(torch.minimum(r * adv, r.clamp(0.8, 1.28) * adv) * m).sum())
    assert "is_weight" not in stats3


def test_with_batch_invariance_off_the_run_records_the_corrected_ratio(rl_root):
    """rl.batch_invariant=false: the correction is on (rl.is_cap=2); a batch serving two steps uses the same
    weights (the first forward's log-probabilities kept, the checkpoint in the middle of it holds them)."""
    flat = ["--rl.batch_invariant=false", "--rl.updates_per_batch=2", "--optim.min_lr=1e-3"]
    assert main(rl_base_args(rl_root, "tis-whole", *flat, "--train.steps=4")) == 0
    assert main(rl_base_args(rl_root, "tis-cut", *flat, "--train.steps=3", "--train.ckpt_every=3")) == 0
    assert main([*rl_base_args(rl_root, "tis-cut", *flat, "--train.steps=4"), "--resume"]) == 0
    whole = [r for r in _records(rl_root / "runs" / "tis-whole") if "loss" in r]
    cut = [r for r in _records(rl_root / "runs" / "tis-cut") if "loss" in r]
    for r in whole:
        assert r["rl/is_weight_max"] >= 0 and 0 < r["rl/is_weight_mean"] <= 2.0
        assert 0 <= r["rl/is_truncated_frac"] <= 1
        assert abs(r["rl/is_weight_mean"] - 1) < 1e-3  # fp32 on a CPU: the forwards differ by ~1e-7
    keys = ("loss", "grad_norm", "rl/is_weight_mean", "rl/entropy")
    assert [r[k] for r in whole[3:] for k in keys] == [r[k] for r in cut[-1:] for k in keys]


def test_in_bf16_the_correction_is_on_though_batch_invariant(rl_root):
    """Batch-invariance makes the sampler's and the trainer's forwards equal in fp32 only: in bf16 (autocast)
    the correction is on with rl.batch_invariant left on; in fp32 it is off (no rl/is_* figures)."""
    assert main(rl_base_args(rl_root, "tis-bf16", "--precision.dtype=bf16", "--train.steps=2")) == 0
    assert main(rl_base_args(rl_root, "tis-fp32", "--train.steps=2")) == 0
    bf16 = [r for r in _records(rl_root / "runs" / "tis-bf16") if "loss" in r]
    fp32 = [r for r in _records(rl_root / "runs" / "tis-fp32") if "loss" in r]
    assert bf16 and all(0 < r["rl/is_weight_mean"] <= 2.0 for r in bf16)
    assert fp32 and not any("rl/is_weight_mean" in r for r in fp32)
