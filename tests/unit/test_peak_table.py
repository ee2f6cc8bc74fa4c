"""MFU's datasheet peaks by GPU name, without a GPU: the device name is what torch.cuda would report.
Compared against: NVIDIA's dense bf16 tensor-core figures (A100 312, H100 SXM 989, H100 PCIe 756, H200 989
TFLOP/s); an unknown GPU has no peak (MFU n/a), never a guessed default."""

from __future__ import annotations

import pytest
import torch

from loom import metrics
from loom.metrics import Throughput, format_step, peak_flops


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "fp16", 312.0),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "bf16", 989.0),
        ("NVIDIA H100 80GB HBM3", "fp32", 67.0),
    ],
)
def test_known_gpus(monkeypatch, name, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), dtype) == tflops * 1e12


def test_unknown_gpu_shows_mfu_as_na(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU 9000")
    peak = peak_flops(torch.device("cuda", 0), "bf16")
    assert peak is None
    rec = Throughput(1000, peak, 1, skip=0).step(tokens=100, dt=0.1)
    assert rec["mfu"] is None
    line = format_step(
        {
            "step": 1,
            "loss": 1.0,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "dt": 0.1,
            "dtf": 0.0,
            "dtb": 0.0,
            "mem_bytes": 0,
            **rec,
        }
    )
    assert "n/a" in line
    assert "H100" in metrics.GPU_PEAK_TFLOPS and "H200" in metrics.GPU_PEAK_TFLOPS
