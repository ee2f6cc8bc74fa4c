"""Bad input through the CLI: one clear message naming the remedy, exit code 2, and nothing written or
overwritten. Each case is compared against that contract, not against a reference implementation."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from loom.cli import main


def _corrupt_header(data, tmp):
    d = tmp / "bad"
    shutil.copytree(data, d)
    raw = bytearray((d / "train_000000.bin").read_bytes())
    raw[0] ^= 0xFF  # magic
    (d / "train_000000.bin").write_bytes(bytes(raw))
    return d


def _truncated(data, tmp):
    d = tmp / "trunc"
    shutil.copytree(data, d)
    raw = (d / "val_000000.bin").read_bytes()
    (d / "val_000000.bin").write_bytes(raw[: len(raw) - 100])
    return d


CASES = {
    "unknown key": (["--model.n_layers=2"], "did you mean 'model.n_layer'"),
    "wrong type": (["--train.steps=many"], "expects int"),
    "batch not divisible": (["--train.batch_size=10", "--train.micro_batch_size=4"], "not divisible"),
    "heads": (["--model.n_embd=30", "--model.n_head=4"], "not divisible by model.n_head"),
    "block too large": (["--model.block_size=100000"], "larger than the"),
    "not prepared": (["--data.path={tmp}"], "not a prepared data directory"),
    "missing data": (["--data.path={tmp}/nope"], "is not a directory"),
    "bad header": (["--data.path={bad}"], "not an llm.c/loom token shard"),
    "truncated shard": (["--data.path={trunc}"], "truncated or corrupt"),
    "resume nothing": (["--resume", "--run.name=none"], "does not exist"),
    "unknown dp_impl": (["--parallel.dp_impl=horovod"], "must be one of"),
    "nproc vs batch": (["--nproc=3", "--train.batch_size=8"], "not divisible by the data-parallel size 3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_train_input(case, char_data, tmp_path, capsys):
    args, message = CASES[case]
    bad = _corrupt_header(char_data, tmp_path) if "{bad}" in " ".join(args) else None
    trunc = _truncated(char_data, tmp_path) if "{trunc}" in " ".join(args) else None
    runs = tmp_path / "runs"
    args = [a.format(tmp=tmp_path, bad=bad, trunc=trunc) for a in args]
    if not any(a.startswith("--data.path") for a in args):
        args.append(f"--data.path={char_data}")
    rc = main(["train", f"--run.dir={runs}", "--train.steps=2", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert err.count("loom: error:") == 1
    assert not runs.exists()  # nothing written before the error


def test_existing_run_is_refused_then_force(char_data, tmp_path, capsys):
    common = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=r",
        "--train.steps=2",
        "--model.n_layer=1",
        "--model.n_embd=32",
        "--model.block_size=16",
        "--train.sample_every=0",
    ]
    assert main(common) == 0
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    assert main([*common, "--train.steps=3"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run with a different config (train.steps: 2 -> 3)" in err and "--resume" in err
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before  # untouched
    assert main([*common, "--force"]) == 0


def test_resume_without_checkpoint(char_data, tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    (run / "config.toml").write_text("[train]\nsteps = 2\n")
    assert (
        main(["train", f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=r", "--resume"]) == 2
    )
    assert "no valid checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--input", "{tmp}/missing.txt"], "does not exist"),
        (["--input", "{tmp}/empty.txt"], "corpus is empty"),
        (["--input", "{tmp}/blob.bin"], "looks binary"),
        (
            ["--input", "{tmp}/a.txt", "--tokenizer", "bpe", "--vocab-size", "100"],
            "too small for byte-level BPE",
        ),
    ],
)
def test_bad_prepare_input(tmp_path, capsys, args, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text("hello world " * 100)
    (tmp_path / "blob.bin").write_bytes(np.arange(1000, dtype=np.int32).tobytes())
    out = tmp_path / "out"
    rc = main(["data", "prepare", *[a.format(tmp=tmp_path) for a in args], "--out", str(out)])
    assert rc == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_resume_with_another_optimizer_names_the_optimizer(char_data, tmp_path, capsys):
    """An optimizer change on resume was called a change of "model settings"."""
    common = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=r",
        "--model.n_layer=1",
        "--model.n_embd=32",
        "--model.block_size=16",
        "--train.sample_every=0",
        "--train.eval_every=0",
    ]
    assert main([*common, "--train.steps=2"]) == 0
    capsys.readouterr()
    assert main([*common, "--train.steps=4", "--resume", "--optim.name=muon"]) == 2
    err = capsys.readouterr().err
    assert "does not fit this optimizer" in err and "optimizer settings (optim.name" in err, err
    assert "model settings" not in err, err
