"""The MFU peak of this GPU, read from its real device name: the datasheet entry for a known GPU (A100,
H100, H200, ...) and None (shown as n/a) for one not in the table. The table itself is tested without a GPU
in tests/unit/test_peak_table.py. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from loom.metrics import GPU_PEAK_TFLOPS, peak_flops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_peak_of_this_gpu():
    name = torch.cuda.get_device_name(0)
    key = next((k for k in GPU_PEAK_TFLOPS if k in name), None)
    peak = peak_flops(torch.device("cuda", 0), "bf16")
    if key is None:
        assert peak is None, f"{name} is not in the table: MFU must be n/a, not a guess"
    else:
        assert peak == GPU_PEAK_TFLOPS[key]["bf16"] * 1e12
    if any(k in name for k in ("A100", "H100", "H200")):
        assert peak is not None, f"{name}: a GPU the issue names has a peak"
