"""Compressed gradient all-reduce on two gloo ranks (DDP communication hooks). Compared against: the bytes a
step hands the all-reduce uncompressed (every fp32 gradient once), read from the run's metrics.jsonl:
bf16 halves them, PowerSGD sends everything during its warm-up and then P and Q; and the runs finish with a
model whose gradients fill two DDP buckets (PowerSGD once hung gloo there: loom.parallel.ddp)."""

from __future__ import annotations

from loomrun import loom_ok
from tiny import tiny_args

from loom.metrics import read_jsonl

# width 128: 1.6 MB of gradients, more than DDP's first 1 MB bucket
MODEL = tiny_args({"model.n_embd": 128, "train.micro_batch_size": 4})


def _bytes(data, runs, name: str, *flags: str) -> list[int]:
    loom_ok(
        "train",
        f"--data.path={data}",
        f"--run.dir={runs}",
        f"--run.name={name}",
        "--train.steps=5",
        "--nproc=2",
        "--parallel.timeout_s=60",
        *MODEL,
        *flags,
    )
    return [r["allreduce_bytes"] for r in read_jsonl(runs / name / "metrics.jsonl") if "loss" in r]


def test_bf16_and_powersgd_bytes_per_step(char_data, tmp_path):
    full = _bytes(char_data, tmp_path, "none")
    assert len(set(full)) == 1 and full[0] > 2**20  # every trained fp32 gradient, every step
    assert _bytes(char_data, tmp_path, "bf16", "--parallel.grad_compression=bf16") == [full[0] // 2] * 5
    flags = [
        "--parallel.grad_compression=powersgd",
        "--parallel.powersgd_warmup=2",
        "--parallel.powersgd_rank=2",
    ]
    psgd = _bytes(char_data, tmp_path, "powersgd", *flags)
    assert psgd[:2] == full[:2]  # the warm-up: plain all-reduce
    assert all(b < full[0] / 10 for b in psgd[2:]), psgd  # then rank-2 factors (and the vectors whole)
