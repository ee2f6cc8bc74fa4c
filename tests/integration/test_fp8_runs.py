"""FP8 runs end to end (`loom train`, one process): an fp8 run resumes onto its own curve bit for bit (no
float8 state is saved: the scales come from the weights), and its checkpoint resumes as a bf16 run (plain
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


def test_fp8_resumes_bit_exact_and_into_bf16(char_data, tmp_path):
    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--train.steps=6",
        "--train.ckpt_every=3",
        "--train.keep_last=5",
        "--precision.dtype=bf16",
        "--precision.fp8=tensorwise",
        "--precision.fp8_filter=all",
        *TINY,
    ]
    assert main([*args, "--run.name=ref"]) == 0
    ref = _curve(tmp_path / "ref")
    shutil.copytree(tmp_path / "ref", tmp_path / "again")
    shutil.rmtree(tmp_path / "again" / "ckpt" / "step_000006")
    step3 = tmp_path / "again" / "ckpt" / "step_000003"
    assert main(["train", "--resume", str(step3)]) == 0
    assert _curve(tmp_path / "again") == ref  # steps 4-6 again, the same bits

    shutil.copytree(tmp_path / "ref", tmp_path / "bf16")
    shutil.rmtree(tmp_path / "bf16" / "ckpt" / "step_000006")
    assert (
        main(["train", "--resume", str(tmp_path / "bf16" / "ckpt" / "step_000003"), "--precision.fp8=off"])
        == 0
    )
    bf16 = _curve(tmp_path / "bf16")
    assert bf16[3] == ref[3]
    for step in (4, 5, 6):  # the same weights in bf16: the float8 roundings' difference only
        assert bf16[step] != ref[step] and abs(bf16[step] - ref[step]) < 0.02 * ref[step]
