"""Data parallelism with torch's DistributedDataParallel.

DDP wraps the single-device model; gradients are all-reduced (averaged) in buckets during backward, and
with gradient accumulation only the last micro-step communicates, through DDP's public `no_sync()`. DDP
broadcasts rank 0's parameters and buffers at construction, so every rank starts equal.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from loom import compat


def apply_ddp(model: nn.Module, device: torch.device, ignore: list[str] = ()) -> DistributedDataParallel:
    """ignore: parameter names DDP leaves alone (expert weights under expert parallelism: each rank holds
    different ones, synchronised by loom.parallel.expert)."""
    ids = [device.index] if device.type == "cuda" else None
    if ignore:
        compat.ddp_ignore(model, list(ignore))
    return DistributedDataParallel(model, device_ids=ids)
