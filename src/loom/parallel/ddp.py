"""Data parallelism with torch's DistributedDataParallel.

DDP wraps the single-device model; gradients are all-reduced (averaged) in buckets during backward. With
gradient accumulation only the last micro-step communicates, through DDP's public `no_sync()`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from loom.parallel.base import DataParallel


class TorchDDP(DataParallel):
    """The DataParallel value the trainer uses: wrap, no_sync, sums across ranks, broadcast."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP broadcasts rank 0's parameters and buffers at construction, so every rank starts equal."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    def no_sync(self, model: torch.nn.Module, skip: bool):
        return model.no_sync() if skip else contextlib.nullcontext()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def after_backward(self) -> None:
        """DDP has already averaged the gradients during backward."""

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Rank 0's weights to every rank (used after loading a checkpoint)."""
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
