"""On a CUDA GPU a training step never makes the host wait per micro-batch: no cudaDeviceSynchronize at
all, and stream synchronisations only for the step's one read of its scalars (loss and grad norm),
counted in a profiler trace of one step with 4 accumulation micro-batches. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from loom.config import Config, validate
from loom.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_step_reads_the_device_once(tmp_path, char_data):
    cfg = Config()
    m, t = cfg.model, cfg.train
    m.n_layer, m.n_head, m.n_embd, m.block_size = 2, 2, 64, 32
    t.batch_size, t.micro_batch_size, t.device, t.eval_batches = 16, 4, "cuda", 1
    cfg.precision.dtype = "bf16"
    trainer = Trainer(cfg, validate(cfg)[0], tmp_path / "run", char_data, torch.device("cuda", 0))
    assert trainer.derived.grad_accum == 4
    trainer.train_step()  # warm-up: allocations, kernels chosen
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        rec = trainer.train_step()
    names = [e.name for e in prof.events()]
    assert names.count("cudaDeviceSynchronize") == 0, "a device-wide wait inside the step"
    assert names.count("cudaStreamSynchronize") <= 2, names.count("cudaStreamSynchronize")
    assert "dtf" not in rec  # per-micro-batch timing only with metrics.detail on GPUs
