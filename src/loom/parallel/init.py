"""Meta-device initialisation: build on `meta`, parallelize, then allocate and fill only the local shards.

A model built on the meta device has shapes but no storage, so no rank ever holds the whole fp32 model: after
tensor parallel, the pipeline split and FSDP have replaced its parameters by their local pieces,
`to_empty` allocates those pieces on the device and `materialize` fills them. Each parameter's values are
made whole on the device from a generator seeded by (run seed, parameter name) by the model's own rule, and
this rank's slice is copied out, so every layout starts from the weights one process would have; the cost
is one whole parameter at a time (the largest, often the embedding) on top of the shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from loom.parallel.tensor import is_dtensor, local


def like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `ref`: a DTensor holding this rank's slice when ref is one (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=local(ref).device, dtype=ref.dtype)
    if is_dtensor(ref):
        return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)
    return full


def canonical(name: str, aliases: dict[str, str]) -> str:
    """The single-device model's name of a parameter (wrappers' prefixes removed, tied aliases resolved)."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return aliases.get(name, name)


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device,
    init: Callable[[str, torch.Tensor], None] | None,
    aliases: dict[str, str],
) -> None:
    """Allocate the model's (local) parameters on device and give each its initial values:
    `init(name, whole)` fills the whole tensor of the single-device parameter `name` (None: left
    uninitialised, for a model whose every value is then loaded)."""
    model.to_empty(device=device)
    if init is None:
        return
    for name, p in model.named_parameters():
        whole = torch.empty(p.shape, dtype=p.dtype, device=device)  # a DTensor's shape is the global one
        init(canonical(name, aliases), whole)
        local(p).copy_(local(like(whole, p)))
        del whole
    for name, b in model.named_buffers():  # a buffer the model keeps (a MoE's balance bias) starts defined
        init(canonical(name, aliases), b)


def load_full(
    params: dict[str, torch.Tensor], full: dict[str, torch.Tensor], aliases: dict[str, str]
) -> None:
    """Copy whole tensors (a checkpoint's or a pretrained model's, by single-device name) into each
    parameter's local piece."""
    with torch.no_grad():
        for name, p in params.items():
            key = canonical(name, aliases)
            if key not in full and key.endswith((".lora_A", ".lora_B")):
                continue  # LoRA adapters on pretrained weights (model.init_from) keep their init
            local(p).copy_(local(like(full[key], p)))
