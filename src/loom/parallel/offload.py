"""Activation offloading (train.activation_offload, issue 48 item 4): the tensors autograd saves for the backward
pass are kept in host memory and copied back when the backward needs them (layer 3).

Saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`, the mechanism of torch's `save_on_cpu`) around
each forward: `pack` copies a device tensor into host memory (page-locked where an accelerator exists, copied
without blocking the host) and drops the device one; `unpack` copies it back on the same stream, so the copy is
ordered before the kernels that read it and no synchronisation is needed. Parameters are left where they are
(they live on the device anyway: offloading them would copy the weights twice a step for nothing), and so are
DTensors (tp's sharded activations: a host copy of a DTensor would need its placements; plain activations are
what tp and FSDP save).  The copies
run on the compute stream: simple, and exact, but not overlapped with compute (torchtitan's and Megatron's
offloaders overlap them on a side stream; that is the next step if the copies show in the step time).

It composes by construction: activation checkpointing's own hooks take over inside a checkpointed block (what
it keeps is then the block's input, which these hooks offload); FSDP's gathered weights are parameters; tp and
pp save ordinary (or DTensor) activations through the same hooks. Values are copied bit for bit, so the
gradients are those of the run without it. On a CPU nothing moves (the tensor is already in host memory): the
hooks only count what a device would have offloaded (`saved_bytes`), which is how the dry run reports it.
"""

from __future__ import annotations

import contextlib

import torch

from loom import compat
from loom import device as dev


def stays_on_device(t: torch.Tensor) -> bool:
    """Left on the device: a parameter or a view of one (autograd saves a weight as its transpose), a DTensor."""
    return (
        isinstance(t, torch.nn.Parameter)
        or isinstance(compat.view_base(t), torch.nn.Parameter)
        or compat.local_tensor(t) is not None
    )


class ActivationOffload:
    """The hooks, and the bytes they packed since the last `reset()` (what a device would hold without them)."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.device, self.enabled = device, enabled
        self.pin = device.type != "cpu" and dev.can_pin()
        self.saved_bytes = 0

    def reset(self) -> int:
        """The bytes packed since the last reset; counting starts again."""
        n, self.saved_bytes = self.saved_bytes, 0
        return n

    def _pack(self, t: torch.Tensor):
        if stays_on_device(t):  # weights; DTensors
            return t
        self.saved_bytes += t.numel() * t.element_size()
        if t.device.type == "cpu":  # already in host memory
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        return t.device, host

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=self.pin)

    def __call__(self):
        """The context to run a forward in (a no-op when disabled)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
