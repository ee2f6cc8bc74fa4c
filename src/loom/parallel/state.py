"""Checkpoint state as whole tensors under the single-device model's names, from any layout.

Every parameter is made whole (DTensor.full_tensor: a collective over its own mesh,
so only the ranks of one pipeline stage take part), kept on global rank 0, and with pipeline parallel each
stage's first rank sends its stage there (gather_object). Loading slices each rank's piece out of the whole
tensors (loom.parallel.init.load_full), so a checkpoint saved under one layout resumes under any other and
`loom generate` reads it as a plain model. Checkpoints are now written sharded (dcp_state.py); this path
remains for a whole copy to sample from when the model is split, and to load checkpoints of format 1
(whole model and optimizer state, which only earlier mains wrote).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.config.layout import ParallelDims
from loom.parallel.init import canonical, like, load_full
from loom.parallel.tensor import is_dtensor, plain


def _whole(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    t = plain(t)  # no float8 all-gather wrapper (precision.fp8 under FSDP) in a whole copy
    full = t.full_tensor() if is_dtensor(t) else t
    return full.detach().cpu() if keep else None


def _sender(dims: ParallelDims) -> bool:
    """One rank per pipeline stage holds its stage's whole state: dp 0, tp 0."""
    return dims.dp_rank == 0 and dims.tp_rank == 0


def _merge_stages(part: dict, dims: ParallelDims) -> list[dict]:
    if not dims.pp_enabled:
        return [part]
    parts = [None] * dims.world_size if dims.is_main else None
    dist.gather_object(part if _sender(dims) else None, parts, dst=0)
    return [p for p in parts or [] if p]


def model_state(model: nn.Module, dims: ParallelDims, names: list[str], aliases: dict[str, str]) -> dict:
    """{name: whole tensor} of the single-device model, in its order, on global rank 0; {} elsewhere."""
    keep = _sender(dims)
    part: dict = {}
    for k, v in model.state_dict().items():
        name = canonical(k, aliases)
        if name not in part:  # a tied tensor once
            part[name] = _whole(v, keep)
    merged: dict = {}
    for p in _merge_stages(part, dims):
        merged.update(p)
    return {n: merged[canonical(n, aliases)] for n in names} if dims.is_main else {}


def load_model_state(model: nn.Module, sd: dict, aliases: dict[str, str]) -> None:
    load_full(model.state_dict(keep_vars=True), sd, aliases)


def _optimizer_names(model: nn.Module, opt, aliases) -> list[str]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return [canonical(ids[id(p)], aliases) for g in opt.param_groups for p in g["params"]]


def load_optim_state(model: nn.Module, opt, sd: dict, order: list[list[str]], aliases) -> None:
    full_order = [n for g in order for n in g]
    names = _optimizer_names(model, opt, aliases)
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, (name, p) in enumerate(zip(names, params, strict=True)):
        s = sd["state"].get(full_order.index(name))
        if s is not None:
            state[i] = {k: like(v, p) if v.dim() else v for k, v in s.items()}
    local_ids = {id(p): i for i, p in enumerate(params)}
    groups = [
        {**g, "params": [local_ids[id(p)] for p in mine["params"]]}
        for g, mine in zip(sd["param_groups"], opt.param_groups, strict=True)
    ]
    opt.load_state_dict({"state": state, "param_groups": groups})


def held_bytes(tensors) -> int:
    """Bytes this rank holds for these tensors (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            piece = t.to_local() if is_dtensor(t) else t
            total += piece.numel() * piece.element_size()
    return total


def model_state_bytes(model: nn.Module, opt) -> dict[str, int]:
    """Parameters, gradients and optimizer state actually held by this rank."""
    params = list(model.parameters())
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its local shard in .optim
    states = [
        v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "params": held_bytes(params),
        "grads": held_bytes(p.grad for p in params),
        "optim": held_bytes(states),
    }
