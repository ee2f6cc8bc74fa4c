"""Issue 48 on a CUDA GPU: activation offloading gives the same gradients bit for bit and holds less device
memory after the forward; a real out-of-memory error dumps the allocator's history as memory_viz's pickle; the
phase clock's spans are events that `take()` reads without waiting. Skipped without CUDA (written on a CPU-only
machine: not yet run on a GPU)."""

from __future__ import annotations

import pickle

import pytest
import torch

from loom.config import Config
from loom.distributed.stragglers import PhaseClock
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.parallel.offload import ActivationOffload
from loom.train.memory import MemorySnapshots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _step(model, x, hooks):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with hooks():
        loss = model(x, x)  # the mean cross-entropy
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    return held, [p.grad.clone() for p in model.parameters()]


def test_offload_same_gradients_less_device_memory():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=4, n_head=4, n_embd=256, block_size=1024)).cuda()
    x = torch.randint(0, 97, (2, 1024), device="cuda")
    held_off, g_off = _step(model, x, ActivationOffload(torch.device("cuda"), enabled=False))
    hooks = ActivationOffload(torch.device("cuda"))
    held_on, g_on = _step(model, x, hooks)
    assert all(torch.equal(a, b) for a, b in zip(g_off, g_on, strict=True))
    assert held_on < held_off / 2, (held_on, held_off)
    print(f"\n[offload cuda] held after forward {held_off / 2**20:.1f} -> {held_on / 2**20:.1f} MiB")


def test_real_oom_dumps_the_history(tmp_path):
    cfg = Config()
    cfg.train.memory_snapshot = "on_oom"
    snaps = MemorySnapshots(cfg, 0, tmp_path, torch.device("cuda"))
    try:
        torch.empty(2**50, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        stop = snaps.out_of_memory(3, e)
    path = tmp_path / "memory" / "oom_step3_rank0.pickle"
    assert path.is_file() and str(path) in stop.message and "memory_viz" in stop.message
    assert "segments" in pickle.loads(path.read_bytes())


def test_phase_clock_reads_events_without_waiting():
    clock = PhaseClock(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    with clock("forward"):
        for _ in range(20):
            a = a @ a / 4096
    first = clock.take()  # may keep the span for later if the GPU has not reached its end
    torch.cuda.synchronize()
    second = clock.take()
    assert first["forward"] + second["forward"] > 0 and clock.pending == []
