"""precision.dtype=auto and the CPU allocator setting (loom.train.setup) against what they promise:
auto follows the device's bf16 support; cpu_memory_reuse applies glibc's options inside and restores them."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from loom.train.setup import cpu_memory_reuse, native_bf16_cpu, resolve_precision


def test_explicit_dtypes_pass_through():
    for d in ("fp32", "bf16", "fp16"):
        assert resolve_precision(d, torch.device("cpu")) == d


def test_auto_on_cpu_follows_bf16_units():
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if native_bf16_cpu() else "fp32")
    assert resolve_precision("auto", torch.device("meta")) == "fp32"


@pytest.mark.parametrize("bf16,want", [(True, "bf16"), (False, "fp16")])
def test_auto_on_cuda(monkeypatch, bf16, want):
    # the GPU's answer is stubbed so this runs without one: Ampere and later -> bf16, older -> fp16 + scaling
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_precision("auto", torch.device("cuda")) == want
    # pipeline parallel cannot scale the loss (config refuses an explicit fp16 with pp > 1): fp32 then
    assert resolve_precision("auto", torch.device("cuda"), loss_scaling=False) == ("bf16" if bf16 else "fp32")


def test_cpu_memory_reuse_is_a_context():
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    with cpu_memory_reuse(True) as applied:
        assert applied == glibc
        x = torch.ones(8 << 20)  # 32 MB: served from the heap while inside
        assert float(x.sum()) == 8 << 20
    with cpu_memory_reuse(False) as applied:
        assert applied is False
