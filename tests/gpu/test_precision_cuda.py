"""Mixed precision on a CUDA GPU: bf16 autocast runs the matmuls in bf16 and the loss falls; fp16 with
dynamic loss scaling detects, counts and skips overflow steps, and the GradScaler's state is in the
checkpoint and restored on resume. Compared against: the dtypes autocast must give, the scale the run
reported. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from loom import checkpoint
from loom.cli import main
from loom.config import Config, validate
from loom.metrics import read_jsonl
from loom.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BABY = [
    "--model.n_layer=4",
    "--model.n_head=4",
    "--model.n_embd=128",
    "--model.block_size=64",
    "--train.batch_size=8",
    "--train.eval_batches=1",
    "--optim.warmup_steps=5",
    "--train.sample_every=0",
    "--train.eval_every=0",
    "--optim.lr=2e-3",
    "--train.log_every=1",
    "--train.device=cuda",
]


def records(run_dir):
    recs = read_jsonl(run_dir / "metrics.jsonl")
    return [r for r in recs if "loss" in r], next(r["summary"] for r in recs if "summary" in r)


def test_bf16_autocast_on_cuda(tmp_path, char_data):
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size = 2, 2, 64, 32
    cfg.train.batch_size, cfg.train.device, cfg.precision.dtype = 8, "cuda", "bf16"
    trainer = Trainer(cfg, validate(cfg)[0], tmp_path / "run", char_data, torch.device("cuda", 0))
    assert trainer.precision == "bf16" and not trainer.scaler.is_enabled()
    x, _ = trainer.batches.next_batch()
    with trainer._autocast():
        logits = trainer.model(x)
    assert logits.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters()), "master weights stay fp32"
    assert (
        main(
            [
                "train",
                f"--data.path={char_data}",
                f"--run.dir={tmp_path}",
                "--run.name=bf16",
                *BABY,
                "--train.steps=30",
                "--precision.dtype=bf16",
            ]
        )
        == 0
    )
    recs, _ = records(tmp_path / "bf16")
    assert all(math.isfinite(r["loss"]) for r in recs) and recs[-1]["loss"] < recs[0]["loss"] - 0.3


def test_fp16_loss_scaling_and_scaler_state_in_the_checkpoint(tmp_path, char_data):
    # 2**24 overflows fp16 gradients in the first steps: each is skipped and the scale halves
    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=fp16",
        *BABY,
        "--precision.dtype=fp16",
        f"--precision.init_scale={2.0**24}",
    ]
    assert main([*args, "--train.steps=30"]) == 0
    recs, summary = records(tmp_path / "fp16")
    overflowed = [r for r in recs if r["overflow"]]
    assert summary["overflow_steps"] == len(overflowed) > 0
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert summary["loss_scale"] < 2.0**24
    tensors, _ = checkpoint.load(tmp_path / "fp16" / "ckpt" / "step_000030", map_location="cpu")
    assert tensors["extra"]["scaler"]["scale"] == pytest.approx(summary["loss_scale"])
    # resumed, the run continues from the backed-off scale: no new overflow at the start
    assert main([*args, "--train.steps=35", "--resume"]) == 0
    recs, _ = records(tmp_path / "fp16")
    resumed = [r for r in recs if r["step"] > 30]
    assert resumed and not resumed[0]["overflow"]
