"""precision.dtype=auto is the default (issue 58): bf16 where the device has bf16 units, fp32 where bf16 would be
emulated, and the run's first lines say the choice and why. Compared against loom.train.setup's own rule
(resolve_precision, native_bf16_cpu) and against a real run's console."""

from __future__ import annotations

import torch
from loomrun import loom_ok
from tiny import tiny_args

from loom.config import Config
from loom.env import native_bf16_cpu
from loom.train.setup import precision_reason, resolve_precision


def test_precision_auto_is_the_default_and_says_why():
    assert Config().precision.dtype == "auto"
    cpu = torch.device("cpu")
    dtype = resolve_precision("auto", cpu)
    assert dtype == ("bf16" if native_bf16_cpu() else "fp32")
    assert precision_reason("bf16", cpu) == "this CPU has bf16 units (AVX512-BF16/AMX)"
    assert "would be emulated" in precision_reason("fp32", cpu)


def test_a_run_on_the_default_says_its_precision_first(char_data, tmp_path):
    """No precision.dtype given (tests/tiny.py pins fp32: left out here): the choice is said before the model."""
    args = tiny_args({"precision.dtype": None, "train.steps": 2})
    r = loom_ok("train", f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=p", *args)
    lines = r.stdout.splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("precision "))
    assert said < next(i for i, line in enumerate(lines) if line.startswith("model ")), r.stdout
    dtype = "bf16" if native_bf16_cpu() else "fp32"
    assert lines[said].startswith(f"precision {dtype} (precision.dtype=auto: "), lines[said]
    assert precision_reason(dtype, torch.device("cpu")) in lines[said]
