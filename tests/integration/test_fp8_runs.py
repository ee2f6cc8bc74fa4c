"""FP8 runs end to end (`loom train`): an fp8 run under FSDP (float8 all-gather) resumes onto its own curve
bit for bit (no float8 state is saved: the scales come from the weights; the sharded checkpoint holds plain
tensors, not torchao's all-gather wrapper), and the same checkpoint resumes on one process as a bf16 run (plain
high-precision weights under the usual names), which continues near the fp8 curve."""

from __future__ import annotations

import shutil

import pytest
from loomrun import TINY

from loom.cli import main
from loom.metrics import read_jsonl

pytest.importorskip("torchao.float8", reason="the loom[fp8] extra (torchao) is not installed")


def _curve(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def test_fp8_fsdp_resumes_bit_exact_and_into_bf16_on_one_process(char_data, tmp_path):
    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--train.steps=4",
        "--train.ckpt_every=2",
        "--train.keep_last=5",
        "--precision.dtype=bf16",
        "--precision.fp8=tensorwise",
        "--precision.fp8_filter=all",
        "--parallel.dp_impl=fsdp",
        *TINY,
    ]
    assert main([*args, "--nproc", "2", "--run.name=ref"]) == 0
    ref = _curve(tmp_path / "ref")
    # plain tensors on disk: a process without torchao (weights-only unpickling) can read every file
    files = [f for f in (tmp_path / "ref" / "ckpt" / "step_000002").rglob("*") if f.is_file()]
    assert files and not any(b"torchao" in f.read_bytes() for f in files)
    for name in ("again", "bf16"):
        shutil.copytree(tmp_path / "ref", tmp_path / name)
        shutil.rmtree(tmp_path / name / "ckpt" / "step_000004")
    assert main(["train", "--nproc", "2", "--resume", str(tmp_path / "again" / "ckpt" / "step_000002")]) == 0
    assert _curve(tmp_path / "again") == ref  # steps 3-4 again, the same bits

    step2 = tmp_path / "bf16" / "ckpt" / "step_000002"
    assert main(["train", "--resume", str(step2), "--precision.fp8=off", "--parallel.dp_impl=none"]) == 0
    bf16 = _curve(tmp_path / "bf16")
    assert bf16[2] == ref[2]
    for step in (3, 4):  # the same weights in bf16 on one process: the float8 roundings' difference only
        assert bf16[step] != ref[step] and abs(bf16[step] - ref[step]) < 0.02 * ref[step]
