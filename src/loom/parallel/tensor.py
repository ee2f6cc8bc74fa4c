"""Tensor and sequence parallelism with DTensor: a plan applied from outside, and what a step needs of it.

The plan ({module path: ParallelStyle}) comes from the model side (the family's ParallelPlan,
loom/model/registry.py); this module knows no model. With the head column-parallel over the vocabulary, the loss runs under `loss_parallel()`,
which computes the cross-entropy from vocabulary shards without gathering the logits.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from loom import compat


def is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage), or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank (sharded or partial: gathered or reduced), or the tensor itself."""
    return t.full_tensor() if is_dtensor(t) else t


def vocab_shards(t) -> int:
    """How many shards a vocabulary-parallel head's logits (a DTensor sharded on its last dim) are in; 1 else."""
    if not is_dtensor(t) or not any(p.is_shard() and p.dim in (-1, t.dim() - 1) for p in t.placements):
        return 1
    return t.device_mesh.size()


def sharded_log_softmax(logits: torch.Tensor, shards: int) -> torch.Tensor:
    """log_softmax over the last dim of whole logits (n, V), computed as loss_parallel computes it from `shards`
    vocabulary shards: the maximum over all, each shard's sum of exp, the sums added in rank order. The same
    bits as the trainer's log-probabilities under tensor parallel (for 2 shards: an all-reduce of two sums
    adds them in either order alike; more may add them in another order)."""
    if shards == 1:
        return torch.log_softmax(logits, dim=-1)
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    parts = [torch.sum(torch.exp(p.contiguous()), dim=-1, keepdim=True) for p in shifted.chunk(shards, -1)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return shifted - torch.log(total)


def plain(t):
    """t without a wrapper subclass that only steers FSDP's all-gather (torchao's float8 weights under
    precision.fp8: `fsdp_pre_all_gather` and the wrapped `_tensor`), a DTensor's local shard included; the
    same storage. Checkpoints and gathered copies hold plain tensors, so they load anywhere without torchao."""
    if is_dtensor(t):
        inner = plain(compat.local_tensor(t))
        if inner is compat.local_tensor(t):
            return t
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            inner, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    if hasattr(t, "fsdp_pre_all_gather") and isinstance(getattr(t, "_tensor", None), torch.Tensor):
        return t._tensor
    return t


def apply_tp(model: nn.Module, tp_mesh, plan: dict) -> None:
    """Parallelize each module of the plan over tp_mesh, in the plan's order."""
    from torch.distributed.tensor.parallel import parallelize_module

    for path, style in plan.items():
        parallelize_module(model.get_submodule(path) if path else model, tp_mesh, style)


def loss_context(enabled: bool):
    """Around forward and backward when the logits are sharded over the vocabulary."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def align_grads(params) -> None:
    """Lay every DTensor gradient out like its parameter. A vocabulary-parallel embedding's gradient comes back
    Partial (each rank a full-size partial sum); the optimizer and the grad norm read local shards."""
    for p in params:
        if p.grad is not None and is_dtensor(p.grad) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


class LocalLoss(nn.Module):
    """The model with its (replicated DTensor) loss returned as a plain tensor, for the trainer's sums."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx, targets=None):
        out = self.model(idx, targets)
        return out.to_local() if targets is not None and is_dtensor(out) else out
