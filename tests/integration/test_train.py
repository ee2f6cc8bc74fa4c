"""End-to-end `loom train` on tiny data, compared against itself: an uninterrupted run vs the same run
stopped and resumed must give bit-identical losses (CPU, fp32); generate/eval/plot read what train wrote."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny import tiny_args

from loom.cli import main
from loom.metrics import read_jsonl

TINY = tiny_args(
    {
        "train.micro_batch_size": 4,
        "train.sample_tokens": 20,
        "train.sample_every": None,
        "train.log_every": None,
        "train.eval_every": None,
        "train.device": None,
    }
)


def train(data, runs, name, *extra):
    return main(["train", f"--data.path={data}", f"--run.dir={runs}", f"--run.name={name}", *TINY, *extra])


def losses(run_dir, every_line=False):
    """(step, loss) of the run's timeline; every_line: of every record written, superseded ones too."""
    recs = read_jsonl(run_dir / "metrics.jsonl", superseded=every_line)
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def test_train_writes_run_and_loss_falls(char_data, tmp_path):
    assert (
        train(
            char_data,
            tmp_path,
            "r",
            "--train.steps=40",
            "--train.log_every=5",
            "--train.eval_every=20",
            "--train.ckpt_every=20",
            "--train.sample_every=20",
            "--train.keep_last=1",
            "--optim.lr=3e-3",
        )
        == 0
    )
    run = tmp_path / "r"
    for name in ("config.toml", "metrics.jsonl", "samples.txt", "run.json", "tokenizer/meta.json"):
        assert (run / name).is_file(), name
    assert [p.name for p in (run / "ckpt").iterdir()] == ["step_000040"]  # keep_last=1 pruned step 20
    recs = read_jsonl(run / "metrics.jsonl")
    train_recs = [r for r in recs if "loss" in r]
    for key in (
        "step",
        "loss",
        "lr",
        "grad_norm",
        "dt",
        "dtf",
        "dtb",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "mfu",
        "mem_bytes",
    ):
        assert key in train_recs[-1], key
    # from uniform over the data's own characters (padding ids take no probability), not over the padded 64
    assert train_recs[-1]["loss"] < train_recs[0]["loss"] - 0.5
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(vals) == 2 and vals[1] < vals[0]
    assert "=== step 40" in (run / "samples.txt").read_text()


def test_resume_is_bit_exact(char_data, tmp_path):
    """Dropout and grad accumulation on, so RNG, optimizer and loader state must all come back exactly."""
    common = [
        "--train.steps=12",
        "--train.log_every=1",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.ckpt_every=6",
        "--train.keep_last=5",
        "--model.dropout=0.1",
    ]
    assert train(char_data, tmp_path, "r", *common) == 0
    straight = losses(tmp_path / "r")
    assert [s for s, _ in straight] == list(range(1, 13))
    assert main(["train", "--resume", str(tmp_path / "r" / "ckpt" / "step_000006")]) == 0
    resumed = losses(tmp_path / "r", every_line=True)[12:]
    assert [s for s, _ in resumed] == list(range(7, 13))
    assert resumed == straight[6:]  # exact float equality
    assert losses(tmp_path / "r") == straight  # one timeline: the steps trained again replace the first ones


def test_resume_newest_and_generate_eval_plot(char_data, tmp_path, capsys):
    assert (
        train(char_data, tmp_path, "r", "--train.steps=6", "--train.ckpt_every=3", "--train.sample_every=0")
        == 0
    )
    run = tmp_path / "r"
    # bare --resume with a longer schedule continues the named run from its newest checkpoint
    assert train(char_data, tmp_path, "r", "--train.steps=8", "--resume", "--train.sample_every=0") == 0
    assert (run / "ckpt" / "step_000008").is_dir()
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "The ", "--max-new-tokens", "15", "--seed", "3"]) == 0
    out1 = capsys.readouterr().out
    assert out1.startswith("The ") and len(out1) > 10
    assert (
        main(
            ["generate", str(run), "--prompt", "The ", "--max-new-tokens", "15", "--seed", "3", "--no-cache"]
        )
        == 0
    )
    assert capsys.readouterr().out == out1  # the KV cache changes speed, not text
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert "val loss" in out and "perplexity" in out
    assert main(["plot", str(run), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_python_dash_m_and_help_config(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "loom", "train", "--help-config"], capture_output=True, text=True
    )
    assert r.returncode == 0
    for key in (
        "run.dir",
        "data.path",
        "model.block_size",
        "train.micro_batch_size",
        "optim.grad_clip",
        "precision.dtype",
        "parallel.dp_impl",
    ):
        assert key in r.stdout


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_trains(char_data, tmp_path, dtype):
    assert (
        train(
            char_data,
            tmp_path,
            dtype,
            "--train.steps=20",
            f"--precision.dtype={dtype}",
            "--train.sample_every=0",
            "--train.eval_every=0",
            "--train.log_every=1",
        )
        == 0
    )
    ls = [loss for _, loss in losses(tmp_path / dtype)]
    assert all(map(lambda v: v == v, ls)) and ls[-1] < ls[0]
    cfg_text = (tmp_path / dtype / "config.toml").read_text()
    assert f'dtype = "{dtype}"' in cfg_text
    if dtype == "fp16":
        state = json.loads((tmp_path / dtype / "ckpt" / "step_000020" / "state.json").read_text())
        assert state["step"] == 20


def test_align_bos_reaches_the_training_loader(char_data, tmp_path, capsys):
    assert (
        train(
            char_data,
            tmp_path,
            "a",
            "--train.steps=2",
            "--data.align=bos",
            "--train.eval_every=0",
            "--train.sample_every=0",
        )
        == 0
    )
    assert "data.align=bos:" in capsys.readouterr().out  # the loader's report of windows and dropped tokens
