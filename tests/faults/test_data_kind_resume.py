"""A resumed run keeps the kind of data it trained on (issue 57, fault 5): a DPO run resumed with chat data went on
as SFT in the DPO run's folder (its metrics, its checkpoint, the stored reference dropped), because the stage is
chosen from the data and the loader never compared it with the checkpoint's. Every direction between preference
pairs, conversations, plain token shards, RL prompts and mixtures is refused with one error that names both
kinds, before any step and before any file of the run folder changes.

Compared against: the run folder before the resume (every file's size and modification time) and the
checkpoint's loader position (the kind it was written by); the same resume with the run's own data continues
(exit 0), so the refusal is the kind's and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rlkit import MODEL, QUIET, make_rl_root, rl_args

from loom.cli import main


def _files(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*")}


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> Path:
    """Under one root (tests/rlkit.py's arithmetic task): runs/base (plain text), runs/sft (chat), and here
    pairs prepared with the SFT run's tokenizer and runs/dpo on them, a second plain source of the base's
    characters and runs/mix on both sources, and runs/rl on the task's prompts: each a run of 2 or 3 steps."""
    root = make_rl_root(tmp_path_factory.mktemp("kinds"), sft_steps=2)
    runs = root / "runs"
    small = [*MODEL, *QUIET, "--train.batch_size=8", "--train.steps=2", f"--run.dir={runs}"]
    with open(root / "pairs.jsonl", "w", encoding="utf-8") as f:
        for line in (root / "arith" / "rl_train.jsonl").read_text().splitlines():
            q = json.loads(line)
            wrong = str(int(q["answer"]) + 1)
            f.write(json.dumps({"prompt": q["prompt"], "chosen": q["answer"], "rejected": wrong}) + "\n")
    prep = ["data", "prepare", "--pairs", "--input", str(root / "pairs.jsonl"), "--out", str(root / "pref")]
    assert main([*prep, "--tokenizer", str(runs / "sft"), "--block-size", "32"]) == 0
    dpo = ["dpo", f"--data.path={root / 'pref'}", f"--model.init_from=run:{runs / 'sft'}", "--run.name=dpo"]
    assert main([*dpo, *small]) == 0
    lines = (root / "base.txt").read_text().splitlines()
    (root / "base2.txt").write_text("\n".join(reversed(lines)) + "\n")
    prep = ["data", "prepare", "--input", str(root / "base2.txt"), "--out", str(root / "text2")]
    assert main([*prep, "--tokenizer", "char"]) == 0  # the same characters: the base's own vocabulary
    mix = [f"--data.sources=a={root / 'text'},b={root / 'text2'}", "--data.mix=a:0.5,b:0.5", "--run.name=mix"]
    assert main(["train", *mix, *small]) == 0
    assert main([*rl_args(root, "rl", "--train.steps=2"), *MODEL]) == 0
    return root


RL = ["--rl.max_new_tokens=4", "--rl.reward=exact"]  # an RL config that validates on the 32-token model
# (run, what the resume gives it, the kind it trained on, the kind it is given); paths under the root
DIRECTIONS = [
    ("dpo", ["--data.path={root}/chat"], "preference pairs", "conversations"),  # the report
    ("sft", ["--data.path={root}/pref"], "conversations", "preference pairs"),
    ("sft", ["--data.path={root}/text"], "conversations", "plain token shards"),
    ("base", ["--data.path={root}/chat"], "plain token shards", "conversations"),
    ("base", ["--data.sources=a={root}/text,b={root}/text2", "--data.mix=a:0.5,b:0.5"], "plain", "a mixture"),
    ("mix", ["--data.path={root}/text"], "a mixture", "plain token shards"),
    ("sft", [*RL, "--rl.prompts={root}/arith/rl_train.jsonl"], "conversations", "RL prompts"),
    ("rl", ["--rl.prompts="], "RL prompts", "conversations"),
    ("dpo", [*RL, "--rl.prompts={root}/arith/rl_train.jsonl"], "preference pairs", "RL prompts"),
]


@pytest.mark.parametrize(
    ("run", "given", "was", "now"),
    DIRECTIONS,
    ids=[
        "dpo-chat",
        "sft-pairs",
        "sft-plain",
        "plain-chat",
        "plain-mix",
        "mix-path",
        "sft-rl",
        "rl-chat",
        "dpo-rl",
    ],
)
def test_a_resume_with_another_kind_of_data_is_refused_before_anything_changes(
    kinds, capsys, run, given, was, now
):
    folder = kinds / "runs" / run
    before = _files(folder)
    args = [a.format(root=kinds) for a in given]
    capsys.readouterr()
    code = main(["train", "--resume", str(folder), "--train.steps=6", *args])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert f"trained on {was}" in err and f"gives it {now}" in err, err
    assert "--model.init_from=run:" in err  # the hint: its own data, or a new run from its weights
    assert _files(folder) == before  # no metrics line, no checkpoint, no config.toml rewritten


def test_the_same_resume_with_the_runs_own_data_continues(kinds):
    """The control: what the refusals change (the data) is all that stops them."""
    assert main(["train", "--resume", str(kinds / "runs" / "dpo"), "--train.steps=3"]) == 0
    recs = [json.loads(s) for s in (kinds / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 3 and "dpo/accuracy" in r for r in recs)
