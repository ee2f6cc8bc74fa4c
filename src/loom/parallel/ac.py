"""Activation checkpointing, applied from outside the model to each transformer block (layer 3).

    full       a block keeps only its input; everything inside it is recomputed in the backward pass
    selective  a block keeps the outputs of its matmuls and attention (the expensive ops) and recomputes
               the cheap ones between them: LayerNorm, GELU, residual adds, reshapes
               (torch's selective activation checkpointing with an op policy, as in torchtitan's op-level SAC)

Both use non-reentrant `torch.utils.checkpoint`, which restores the RNG state for the recomputation, so
dropout masks are the same and losses and gradients equal those without checkpointing. The block's
`forward` is wrapped on the instance: module names and parameter names do not change, so checkpoints,
tensor parallelism and HF export see the same model.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from loom import device as dev
from loom.errors import LoomError

MODES = ("none", "full", "selective")


def _saved_ops() -> set:
    """The ops whose outputs selective checkpointing keeps: matmuls and fused attention."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    return ops


def _selective_context():
    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, mode: str, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation and sampling: nothing is kept for a backward pass anyway
        return forward(*args, **kwargs)
    if mode == "full":
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_context, **kwargs)


def apply_ac(blocks: list[torch.nn.Module], mode: str) -> None:
    """Checkpoint each block in `mode` (none | full | selective).

    Applied once, before torch.compile and data parallelism (the order of `loom.parallel`)."""
    if mode not in MODES:
        raise LoomError(
            f"unknown train.activation_checkpointing '{mode}'", hint=f"use one of {', '.join(MODES)}"
        )
    if mode == "none":
        return
    for block in blocks:
        if getattr(block, "_loom_ac", None):
            raise LoomError("activation checkpointing is already applied to this model")
        block.forward = functools.partial(_checkpointed, block.forward, mode)
        block._loom_ac = mode


def activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast=None) -> int:
    """Bytes the forward pass leaves allocated for the backward pass (saved activations, kept inputs).

    Measured as the memory the forward allocates and does not free, with the profiler's allocator events,
    so it counts whatever holds the tensors: autograd's saved tensors, checkpoint frames, SAC caches.
    Gradients are not involved: the loss is dropped after the measurement."""
    from torch.profiler import profile

    with profile(activities=dev.profiler_activities(x.device), profile_memory=True) as prof:
        if autocast is not None:
            with autocast():
                loss = model(x, y)
        else:
            loss = model(x, y)
    del loss
    key = "self_device_memory_usage" if x.device.type in ("cuda", "xpu") else "self_cpu_memory_usage"
    return int(sum(getattr(e, key, 0) for e in prof.events()))
