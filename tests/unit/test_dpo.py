"""Preference tuning (issue 46 item 4): preference pairs prepared as chat data, the DPO and IPO losses, `loom dpo`.

Compared against: the losses' closed forms computed by hand on fixed log-probabilities (-log sigmoid(beta h),
(h - 1/(2 beta))^2); the records as written (each pair's chosen and rejected conversation, in that order, the
mask on the final answer only); the model itself (a pair's log-probability is the sum of its answer tokens'
log-softmax, computed here from the logits); log 2, the loss of the first step, where the policy is the
reference (any reference computed other than from the starting model moves it); and the first step's loss
against the last ones (a tiny run learns the preference).
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sftkit import MODEL, QUIET, WORDS, _sft_args

from loom.cli import main
from loom.config import Config
from loom.data.loader import read_meta
from loom.data.pairs import PairLoader, Pairs, final_answer_mask, record_pair
from loom.data.slice import DataSlice
from loom.data.tokenizers import load_tokenizer
from loom.errors import LoomError
from loom.train.dpo import check_layout, preference_loss, sequence_logps

LN2 = math.log(2)


def test_sigmoid_and_ipo_losses_equal_their_closed_forms():
    policy = torch.tensor([[-3.0, -5.0], [-7.5, -2.0], [-1.0, -1.0]])
    reference = torch.tensor([[-4.0, -4.0], [-6.0, -3.0], [-2.0, -0.5]])
    beta = 0.25
    losses, rewards = preference_loss(policy, reference, beta, "sigmoid")
    for i in range(3):
        h = (policy[i, 0] - reference[i, 0]) - (policy[i, 1] - reference[i, 1])
        assert losses[i].item() == pytest.approx(math.log1p(math.exp(-beta * h.item())), abs=1e-7)
        assert rewards[i].tolist() == pytest.approx((beta * (policy[i] - reference[i])).tolist())
    ipo, _ = preference_loss(policy, reference, beta, "ipo")
    h = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    assert ipo.tolist() == pytest.approx(((h - 1 / (2 * beta)) ** 2).tolist())
    assert preference_loss(reference, reference, beta, "sigmoid")[0].tolist() == pytest.approx([LN2] * 3)


def test_record_forms_and_the_reasons_a_record_is_dropped():
    user = [{"role": "user", "content": "hi"}]
    pair, why = record_pair({"prompt": "hi", "chosen": "a", "rejected": "b"})
    assert why is None and pair == (user, "a", "b")
    turns = [*user, {"role": "assistant", "content": "x"}]  # TRL's conversational form: the prompt implicit
    pair, _ = record_pair({"chosen": turns, "rejected": [*user, {"role": "assistant", "content": "y"}]})
    assert pair == (user, "x", "y")
    pair, _ = record_pair(
        {"messages": user, "chosen": turns[1], "rejected": {"role": "assistant", "content": "z"}}
    )
    assert pair == (user, "x", "z")
    assert record_pair({"prompt": "hi", "chosen": "a", "rejected": "a"})[1] == "chosen equals rejected"
    assert record_pair({"prompt": "hi", "chosen": "a"})[1] == "no chosen and rejected"
    assert record_pair({"prompt": "hi", "chosen": 3, "rejected": "a"})[1].startswith("chosen or rejected")
    assert record_pair({"messages": turns, "chosen": "a", "rejected": "b"})[1].startswith("the prompt ends")
    assert np.array_equal(final_answer_mask(np.array([0, 1, 1, 0, 0, 1, 1, 0])), [0, 0, 0, 0, 0, 1, 1, 0])


def _pairs(n: int, seed: int) -> list[dict]:
    """Reverse the words (chosen) rather than repeat them (rejected); every third prompt after a first turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        w = rng.sample(WORDS, rng.randint(2, 3))
        rec = {"prompt": "reverse: " + " ".join(w), "chosen": " ".join(reversed(w)), "rejected": " ".join(w)}
        if i % 3 == 0:
            rec["messages"] = [
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": w[0]},
                {"role": "user", "content": rec.pop("prompt")},
            ]
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def dpo_root(sft):
    """A chat model (3 SFT steps on the shared tiny base) and preference pairs prepared with its tokenizer."""
    assert main([*_sft_args(sft, "dposft", *MODEL), "--train.steps=3"]) == 0
    records = [*_pairs(80, seed=2), {"prompt": "reverse: apple", "chosen": "apple", "rejected": "apple"}]
    (sft / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    args = ["data", "prepare", "--pairs", "--input", str(sft / "pairs.jsonl"), "--out", str(sft / "pref")]
    assert main([*args, "--tokenizer", str(sft / "runs" / "dposft")]) == 0
    return sft


def test_prepared_pairs_hold_chosen_then_rejected_with_the_final_answer_masked(dpo_root):
    meta = read_meta(dpo_root / "pref")
    assert meta["preference"]["pairs"] == {"train": 72, "val": 8}  # 80 pairs; the equal one dropped, counted
    assert meta["preference"]["dropped"] == {"chosen equals rejected": 1}
    tok = load_tokenizer(dpo_root / "pref", meta)
    pairs = Pairs(dpo_root / "pref", "train", 64)
    x, y = pairs.rows(np.arange(6))
    for i in range(0, 12, 2):
        chosen = tok.decode([t for t in y[i].tolist() if t >= 0])
        rejected = tok.decode([t for t in y[i + 1].tolist() if t >= 0])
        assert chosen.endswith("<|assistant_end|>") and rejected.endswith("<|assistant_end|>")
        words = chosen.removesuffix("<|assistant_end|>").split()
        assert rejected.removesuffix("<|assistant_end|>").split() == words[::-1]  # one prompt, both answers
        assert torch.equal(x[i][: (y[i] >= 0).nonzero()[0]], x[i + 1][: (y[i + 1] >= 0).nonzero()[0]])


def test_pair_batches_do_not_depend_on_the_world_size(dpo_root):
    whole = PairLoader(dpo_root / "pref", 8, 64, 5, DataSlice())
    halves = [PairLoader(dpo_root / "pref", 8, 64, 5, DataSlice(r, 2)) for r in range(2)]
    for _ in range(20):  # past an epoch (72 pairs, 4 a step)
        x, y = whole.next_batch()
        parts = [h.next_batch() for h in halves]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(
            y, torch.cat([p[1] for p in parts])
        )


def test_sequence_logps_sum_the_answer_tokens_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11)
    y = torch.randint(0, 11, (4, 6))
    y[:, :3] = -1
    got = sequence_logps(lambda x: logits, None, y)
    want = torch.stack([sum(F.log_softmax(logits[b, t], -1)[y[b, t]] for t in range(3, 6)) for b in range(4)])
    assert torch.allclose(got, want, atol=1e-6)


def _dpo(root, name: str, *extra: str) -> list[dict]:
    args = [
        "dpo",
        f"--data.path={root / 'pref'}",
        f"--model.init_from=run:{root / 'runs' / 'dposft'}",
        f"--run.dir={root / 'runs'}",
        f"--run.name={name}",
        "--train.batch_size=16",
        "--optim.lr=3e-3",
        "--train.steps=20",
        "--train.log_every=1",
        "--optim.warmup_steps=0",
        *QUIET,
        *extra,
    ]
    assert main(args) == 0
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "step" in r]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_tiny_dpo_run_starts_at_log_2_and_learns_the_preference(dpo_root, lora):
    extra = ["--finetune.lora_rank=4", "--finetune.lora_targets=all-linear"] if lora else []
    recs = _dpo(dpo_root, f"dpo-{'lora' if lora else 'full'}", "--dpo.beta=0.5", *extra)
    assert recs[0]["loss"] == pytest.approx(LN2, abs=1e-5)  # the policy is the reference at the first step
    assert recs[0]["dpo/margin"] == pytest.approx(0, abs=1e-5)
    late = recs[-4:]
    assert sum(r["loss"] for r in late) / 4 < LN2 - 0.05, [r["loss"] for r in recs]
    assert sum(r["dpo/accuracy"] for r in late) / 4 > 0.6
    assert all(
        r["dpo/margin"] == pytest.approx(r["dpo/chosen_reward"] - r["dpo/rejected_reward"]) for r in recs
    )


def test_loom_eval_of_a_dpo_run_scores_what_the_run_scored(dpo_root, capsys):
    """The validation loss is the loss on the validation pairs' chosen answers, in the run and in loom eval."""
    _dpo(dpo_root, "dpo-eval", "--train.steps=2")
    run = dpo_root / "runs" / "dpo-eval"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    val = [r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert f"{val:.4f}" in capsys.readouterr().out


def test_ipo_runs_and_starts_at_its_closed_form(dpo_root):
    recs = _dpo(dpo_root, "ipo", "--dpo.loss=ipo", "--dpo.beta=0.5", "--train.steps=2")
    assert recs[0]["loss"] == pytest.approx(1.0, abs=1e-5)  # h = 0: (0 - 1 / (2 * 0.5))^2
    # loom plot draws the rewards, margin and accuracy beside the loss
    png = dpo_root / "ipo.png"
    assert main(["plot", str(dpo_root / "runs" / "ipo"), "--out", str(png)]) == 0
    assert png.stat().st_size > 0


def test_loom_dpo_refuses_what_it_cannot_tune(dpo_root, capsys):
    assert main(["dpo", f"--data.path={dpo_root / 'pref'}"]) == 2
    assert "model.init_from is not set" in capsys.readouterr().err
    assert main(["dpo", f"--data.path={dpo_root / 'chat'}", "--model.init_from=run:x"]) == 2
    assert "holds no pairs" in capsys.readouterr().err
    cfg = Config()
    cfg.parallel.pp = 2
    with pytest.raises(LoomError, match="pp=2"):
        check_layout(cfg)


def test_bench_train_times_preference_pairs(dpo_root, tmp_path):
    """`loom bench train` on preference data steps as `loom dpo` does: the stage's reference first (it was an
    assertion error)."""
    out = tmp_path / "b.json"
    args = [f"--data.path={dpo_root / 'pref'}", f"--model.init_from=run:{dpo_root / 'runs' / 'dposft'}"]
    assert main(["bench", "train", "--steps", "2", "--warmup", "1", "--json", str(out), *args, *MODEL]) == 0
    assert json.loads(out.read_text())[0]["tokens_per_s"] > 0


def test_a_pair_is_dropped_and_counted_once_whichever_sides_fail(dpo_root, tmp_path):
    """Both answers too long was two drops (one a side) for one record; the counts are of records."""
    long = " ".join(WORDS * 2)
    records = [
        *_pairs(10, seed=3),
        {"prompt": long, "chosen": "apple", "rejected": "river"},  # both sides too long
        {"prompt": "reverse: apple", "chosen": long, "rejected": "apple"},  # the chosen side only
        {"prompt": "reverse: apple", "chosen": "apple", "rejected": "apple"},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    args = ["data", "prepare", "--pairs", "--input", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "p")]
    assert main([*args, "--tokenizer", str(dpo_root / "runs" / "dposft")]) == 0
    meta = read_meta(tmp_path / "p")
    too_long = "longer than --block-size + 1 = 65 tokens"
    assert meta["preference"]["dropped"] == {too_long: 2, "chosen equals rejected": 1}
    assert sum(meta["preference"]["pairs"].values()) == 10
    assert meta["dropped_documents"] == 3


def test_loom_sft_refuses_preference_pairs(dpo_root, capsys):
    """loom train would preference-tune on pairs: `loom sft` says so instead of running DPO."""
    chat_model = f"--model.init_from=run:{dpo_root / 'runs' / 'dposft'}"
    short = ["--train.steps=2", f"--run.dir={dpo_root / 'runs'}", "--run.name=sft-pairs", *QUIET]
    assert main(["sft", f"--data.path={dpo_root / 'pref'}", chat_model, *short]) == 2
    err = capsys.readouterr().err
    assert "holds preference pairs" in err and f"loom dpo --data.path={dpo_root / 'pref'}" in err


def _hint(err: str) -> str:
    return err.split("hint: ", 1)[1].strip()


def test_loom_dpo_from_a_base_run_names_the_chat_model_the_pairs_were_made_for(dpo_root, capsys):
    """The pairs were prepared with the SFT run's tokenizer: the hint names that run, and it trains."""
    pref, runs = f"--data.path={dpo_root / 'pref'}", dpo_root / "runs"
    assert main(["dpo", pref, f"--model.init_from=run:{runs / 'base'}"]) == 2
    err = capsys.readouterr().err
    assert "is a base run" in err
    assert (
        _hint(err)
        == f"start from the chat model the pairs were prepared with: --model.init_from=run:{runs / 'dposft'}"
    )
    tail = ["--train.steps=2", "--train.batch_size=8", f"--run.dir={runs}", "--run.name=from-hint", *QUIET]
    assert main(["dpo", pref, _hint(err).rsplit(": ", 1)[1], *tail]) == 0


def test_the_hint_for_pairs_of_a_base_run_runs_as_written(dpo_root, tmp_path, monkeypatch, capsys):
    """Pairs prepared for a base run are refused (it has no chat tokens); the hint's commands (chat data, loom
    sft, the pairs again, loom dpo) run one after the other as written, with CONVERSATIONS.jsonl a file of
    conversations and, for the two trainings, a short run length added."""
    monkeypatch.chdir(tmp_path)
    base = dpo_root / "runs" / "base"
    args = ["data", "prepare", "--pairs", "--input", str(dpo_root / "pairs.jsonl"), "--out", "p"]
    assert main([*args, "--tokenizer", str(base)]) == 2
    err = capsys.readouterr().err
    assert "has no chat tokens" in err
    commands = _hint(err).split(": ", 1)[1].split(" && ")
    assert [c.split()[:2] for c in commands] == [
        ["loom", "data"],
        ["loom", "sft"],
        ["loom", "data"],
        ["loom", "dpo"],
    ]
    for c in commands:
        argv = c.replace("CONVERSATIONS.jsonl", str(dpo_root / "conv.jsonl")).split()[1:]
        if argv[0] in ("sft", "dpo"):
            argv += ["--train.steps=2", "--train.batch_size=8", *QUIET]
        assert main(argv) == 0, (c, capsys.readouterr().err[-2000:])
    assert (base.parent / "sft" / "ckpt").is_dir()
