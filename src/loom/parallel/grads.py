"""Gradients across a mesh: the global norm (each distinct value counted once) and clipping by it.

With tensor or pipeline parallel a rank holds some gradients whole (replicated over tp or dp) and others as
shards, and each pipeline stage holds different parameters; the tied embedding/head sits on the first and
the last stage. The norm adds up each rank's squares divided by how many ranks hold the same values, in one
all-reduce over the job. Without model parallelism torch's clip_grad_norm_ is exact and cheaper (FSDP's and
HSDP's DTensor gradients included).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.config.layout import ParallelDims
from loom.parallel.tensor import is_dtensor, local, whole


def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    dims: ParallelDims,
    shared: set[str] = frozenset(),
    blocked: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
):
    """The global gradient norm (before clipping); gradients scaled down to max_norm when above it.

    shared: names of parameters whose gradient two pipeline stages hold (the tied embedding and head);
    blocked: a context around the norm's collectives (the straggler monitor's waits: Parallel.blocked)."""
    if not (dims.model_parallel or dims.ep_enabled):
        with blocked():  # FSDP's DTensor norm all-reduces inside (the local norms it computes too are tiny)
            return whole(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    device = next(local(p) for p in model.parameters()).device
    sq = torch.zeros((), dtype=torch.float64, device=device)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        copies = replicas(p.grad, dims) * (2 if name in shared else 1)
        g = local(p.grad)
        grads.append(g)
        sq += g.double().pow(2).sum() / copies
    with blocked():
        dist.all_reduce(sq)
    norm = sq.sqrt().float()
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm


def replicas(g: torch.Tensor, dims: ParallelDims) -> int:
    """How many ranks of this pipeline stage hold exactly this (local) gradient: the stage's dp x cp x tp ranks
    over the product of the mesh dimensions a DTensor gradient is split over (placements other than Replicate:
    Shard, and FSDP's _StridedShard over tensor parallel's shards; flattened dimensions such as FSDP's
    dp_shard_cp, and expert parallelism's efsdp and ep, count by their size)."""
    split = 1
    if is_dtensor(g):
        from torch.distributed.tensor import Replicate

        for i, pl in enumerate(g.placements):
            if not isinstance(pl, Replicate):
                split *= g.device_mesh.size(i)
    return dims.dp * dims.cp * dims.tp // split
