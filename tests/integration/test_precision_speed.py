"""Mixed precision, compile, activation checkpointing and `loom bench train` end to end on tiny data.

Compared against: fp32 runs of the same config (bf16 loss curve within a documented tolerance; activation
checkpointing bit-identical), fp16 with a deliberately huge initial loss scale (overflow steps must be
detected, counted and skipped while the loss still falls), and the checkpoint (scaler state saved)."""

from __future__ import annotations

import json
import math
from importlib.util import find_spec

import pytest
import torch
from tiny import tiny_args

from loom import checkpoint
from loom.cli import main
from loom.metrics import read_jsonl

TINY = tiny_args({"train.log_every": None, "train.device": None})
# nanoGPT's CPU "baby GPT" shape (4 layers, 4 heads, 128 wide, 64 tokens); a smaller batch keeps fp16
# (slow on CPUs without fp16 matmul units) within seconds per step.
BABY = [
    "--model.n_layer=4",
    "--model.n_head=4",
    "--model.n_embd=128",
    "--model.block_size=64",
    "--train.batch_size=4",
    "--train.eval_batches=1",
    "--optim.warmup_steps=5",
    "--train.sample_every=0",
    "--train.eval_every=0",
    "--optim.lr=2e-3",
]

# bf16 keeps 8 bits of mantissa: over a short run from the same start the per-step loss differs from fp32 by
# a few thousandths (measured 0.004 max on this config); 0.03 leaves room for other CPUs and torch versions.
BF16_LOSS_TOL = 0.03


def train(data, runs, name, *extra):
    return main(["train", f"--data.path={data}", f"--run.dir={runs}", f"--run.name={name}", *extra])


def records(run_dir):
    recs = read_jsonl(run_dir / "metrics.jsonl")
    return [r for r in recs if "loss" in r], next(r["summary"] for r in recs if "summary" in r)


def test_bf16_loss_curve_follows_fp32(char_data, tmp_path):
    curves = {}
    for dtype in ("fp32", "bf16"):
        # lr 3e-3: the first loss is uniform over the data's own characters (padding ids take no probability),
        # so learning by 0.5 takes a faster rate than from the padded vocabulary
        assert (
            train(
                char_data,
                tmp_path,
                dtype,
                *TINY,
                "--train.steps=30",
                "--train.log_every=1",
                f"--precision.dtype={dtype}",
                "--optim.lr=3e-3",
            )
            == 0
        )
        curves[dtype] = [r["loss"] for r in records(tmp_path / dtype)[0]]
    a, b = curves["fp32"], curves["bf16"]
    assert len(a) == len(b) == 30
    assert a[-1] < a[0] - 0.5  # it learns
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < BF16_LOSS_TOL


def test_fp16_counts_overflow_steps_and_still_learns(char_data, tmp_path):
    # 2**24 overflows fp16 gradients in the first steps (2**17 fits this model): each is skipped and the
    # scale halves.
    assert (
        train(
            char_data,
            tmp_path,
            "fp16",
            *BABY,
            "--train.steps=30",
            "--train.log_every=1",
            "--precision.dtype=fp16",
            f"--precision.init_scale={2.0**24}",
        )
        == 0
    )
    recs, summary = records(tmp_path / "fp16")
    overflowed = [r["step"] for r in recs if r["overflow"]]
    assert summary["overflow_steps"] == len(overflowed) > 0
    assert recs[-1]["overflow_steps"] == len(overflowed)
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert summary["loss_scale"] < 2.0**24
    # the overflowed steps did not move the weights: the loss only falls once the scale fits
    good = [r["loss"] for r in recs if not r["overflow"]]
    assert len(good) >= 10 and sum(good[-5:]) / 5 < recs[0]["loss"] - 0.3
    # the scaler's state is in the checkpoint, so a resumed run continues with the backed-off scale
    tensors, _ = checkpoint.load(tmp_path / "fp16" / "ckpt" / "step_000030", map_location="cpu")
    assert tensors["extra"]["scaler"]["scale"] == pytest.approx(summary["loss_scale"])


def test_activation_checkpointing_in_training_is_exact(char_data, tmp_path):
    curves = {}
    for mode in ("none", "full", "selective"):
        assert (
            train(
                char_data,
                tmp_path,
                mode,
                *TINY,
                "--train.steps=4",
                "--train.log_every=1",
                "--model.dropout=0.1",
                f"--train.activation_checkpointing={mode}",
            )
            == 0
        )
        curves[mode] = [r["loss"] for r in records(tmp_path / mode)[0]]
    assert curves["full"] == curves["none"] and curves["selective"] == curves["none"]


def test_bench_train_compares_ac_modes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "train",
                "--synthetic",
                "--model.vocab_size=64",
                *TINY,
                "--steps",
                "2",
                "--warmup",
                "1",
                "--ac",
                "none,full,selective",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    recs = json.loads(out.read_text())
    assert [r["ac"] for r in recs] == ["none", "full", "selective"]
    for r in recs:
        assert r["steps"] == 2 and r["tokens_per_s"] > 0 and r["tokens_per_s_per_device"] == r["tokens_per_s"]
        assert r["mfu"] is not None and r["activation_bytes"] > 0 and r["peak_mem_bytes"] > 0
    assert recs[1]["activations_vs_none"] < 0.5 and recs[1]["time_vs_none"] > 0
    assert "tokens/s" in capsys.readouterr().out


def test_bench_train_reads_real_data(char_data, tmp_path):
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "train",
                f"--data.path={char_data}",
                *TINY,
                "--steps",
                "2",
                "--warmup",
                "1",
                "--rounds",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (rec,) = json.loads(out.read_text())
    assert rec["ac"] == "none" and not rec["synthetic"] and rec["tokens_per_step"] == 8 * 32


def test_bench_train_bad_input(tmp_path, capsys):
    assert main(["bench", "train", "--synthetic", "--ac", "half", *TINY]) == 2
    assert "--ac: unknown mode(s) half" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # a folder that is there but holds no prepared data
    assert main(["bench", "train", "--synthetic", f"--data.path={tmp_path / 'empty'}", *TINY]) == 2
    assert "--model.vocab_size" in capsys.readouterr().err


def test_bench_train_synthetic_needs_no_data_folder(tmp_path, capsys):
    """--synthetic reads no data: a config whose data.path is not made yet (docs/training.md's) still measures,
    at data.vocab_size, and says so."""
    args = ["bench", "train", "--synthetic", f"--data.path={tmp_path / 'missing'}", *TINY]
    assert (
        main([*args, "--steps", "1", "--warmup", "0", "--rounds", "1", "--json", str(tmp_path / "r.json")])
        == 0
    )
    out = capsys.readouterr()
    assert "does not exist; measuring with a vocabulary of 4096" in out.out + out.err
    (rec,) = json.loads((tmp_path / "r.json").read_text())
    assert rec["synthetic"]


@pytest.mark.slow
def test_compiled_run_reports_compile_time(char_data, tmp_path):
    pytest.importorskip("torch._inductor")
    assert (
        train(
            char_data,
            tmp_path,
            "c",
            *TINY,
            "--train.steps=6",
            "--train.log_every=1",
            "--train.compile=true",
            "--train.warmup_log_steps=0",
        )
        == 0
    )
    recs, summary = records(tmp_path / "c")
    assert recs[0]["compile_s"] == summary["compile_s"] > 0
    assert all("compile_s" not in r for r in recs[1:])
    # tokens/s leaves the compile step out: it is steps 2-6 only
    later = sum(r["dt"] for r in recs[1:])
    assert summary["tokens_per_s"] == pytest.approx(5 * 8 * 32 / later, rel=1e-6)
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert torch.compiler is not None


@pytest.mark.skipif(find_spec("torchao") is None, reason="the loom[fp8] extra (torchao) is not installed")
def test_bench_train_compares_fp8_recipes(tmp_path):
    """`--fp8 off,tensorwise`: one trainer per recipe, timed in interleaved rounds, each against the first."""
    out = tmp_path / "bench.json"
    args = ["bench", "train", "--synthetic", "--model.vocab_size=64", *TINY, "--steps", "2", "--warmup", "1"]
    assert main([*args, "--precision.fp8_filter=all", "--fp8", "off,tensorwise", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert [(r["mode"], r["fp8"]) for r in recs] == [("off", "off"), ("tensorwise", "tensorwise")]
    assert recs[0]["speed_vs_first"] == 1.0 and recs[1]["speed_vs_first"] > 0


def test_bench_train_fp8_bad_input(capsys):
    assert main(["bench", "train", "--synthetic", "--model.vocab_size=64", *TINY, "--fp8", "e4m3"]) == 2
    assert "--fp8: unknown mode(s) e4m3" in capsys.readouterr().err
    assert main(["bench", "train", "--synthetic", *TINY, "--fp8", "off", "--ac", "full"]) == 2
    assert "give one" in capsys.readouterr().err
