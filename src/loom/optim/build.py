"""AdamW with decoupled weight decay on >=2-D parameters only, and the implementation switch."""

from __future__ import annotations

import torch

from loom.errors import LoomError


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices and embeddings decay; biases and LayerNorm gains do not (nanoGPT, GPT-3 practice)."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def resolve_impl(impl: str, device: torch.device) -> str:
    """auto picks torch's fused AdamW (CPU and CUDA have it), else foreach."""
    if impl == "auto":
        return "torch-fused" if device.type in ("cpu", "cuda", "mps") else "torch-foreach"
    return impl


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer for `cfg.optim` (an OptimConfig); lr is set per step by the schedule."""
    impl = resolve_impl(cfg.impl, device)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    groups = param_groups(model, cfg.weight_decay)
    if impl == "torch-fused":
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    if impl == "torch-foreach":
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
    if impl == "torch-loop":
        return torch.optim.AdamW(groups, foreach=False, fused=False, **kwargs)
    if impl == "triton":  # one fused kernel launch per step for all parameters (needs loom[triton])
        from loom.optim.triton_adamw import TritonAdamW

        return TritonAdamW(groups, **kwargs)
    raise LoomError(
        f"unknown optim.impl '{impl}'", hint="use auto, torch-fused, torch-foreach, torch-loop or triton"
    )
