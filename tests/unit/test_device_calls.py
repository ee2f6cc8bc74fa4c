"""Device-specific calls live in loom/device.py (issue 48, item 6): a grep of src/ finds `torch.cuda`,
`torch.xpu`, `torch.mps`, `torch.backends.cuda|cudnn|mps` and the profiler's device activities nowhere else but
the allow-list below, each with its reason. Compared against: the source text itself, and on a CPU the values
the module's CPU rows must give (nothing to synchronise, the host clock, the process's peak RSS)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from loom import device as dev
from loom import metrics

SRC = Path(__file__).resolve().parents[2] / "src" / "loom"
CALL = re.compile(r"torch\.(cuda|xpu|mps|backends\.(cuda|cudnn|mps))\b|ProfilerActivity\.(CUDA|XPU|MPS)")
# file -> why its device calls stay there
ALLOWED = {
    "device.py": "the one module",
    "compat.py": "torch's private names (the CUDA allocator's history), which device.py reaches through it",
    "doctor.py": "loom doctor reports the CUDA toolchain by name (driver, cuDNN and NCCL versions, TF32 flag)",
}


def test_device_calls_only_in_device_module():
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name not in ALLOWED or path.parent != SRC
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if CALL.search(line)
    ]
    assert not found, "device-specific calls outside loom/device.py: " + "; ".join(found)


def test_cpu_rows():
    cpu = torch.device("cpu")
    dev.synchronize(cpu)  # nothing to wait for
    dev.reset_peak(cpu)
    dev.empty_cache(cpu)
    assert dev.current_stream(cpu) is None and dev.name(cpu) == "" and dev.capability(cpu) is None
    assert dev.peak_memory(cpu) == metrics.peak_memory_bytes(cpu) > 0
    assert dev.get_rng_state(cpu) is None
    assert dev.dist_backend(cpu) == "gloo"
    span = dev.Span(cpu).start()
    time.sleep(0.01)
    assert 0.009 < span.stop().seconds() < 1.0


def test_peak_table_by_device_type(monkeypatch):
    """The CUDA table is the one MFU always used (numbers unchanged); an Intel GPU is a row, not code."""
    assert metrics.GPU_PEAK_TFLOPS is dev.PEAK_TFLOPS["cuda"]
    monkeypatch.setattr(dev, "name", lambda d: "NVIDIA H100 PCIe")
    assert dev.peak_tflops(torch.device("cuda"), "bf16") == 756.0
    monkeypatch.setattr(dev, "name", lambda d: "Intel(R) Data Center GPU Max 1550")
    assert dev.peak_tflops(torch.device("xpu"), "bf16") == 838.9
    assert dev.peak_tflops(torch.device("xpu"), "fp8") is None
    assert dev.dist_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert dev.dist_backend(torch.device("xpu", 0)) == "cpu:gloo,xpu:xccl"
