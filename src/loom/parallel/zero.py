"""ZeRO-1: optimizer state sharded across data-parallel ranks, gradients all-reduced by DDP.

torch's ZeroRedundancyOptimizer gives each rank the Adam moments of a 1/dp share of the parameters; after
its local step it broadcasts the updated parameters (Rajbhandari et al., 2020, stage 1). For checkpoints the
shards are consolidated on rank 0 into torch's ordinary AdamW state, loadable with any implementation.
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from loom.optim.build import param_groups, resolve_impl


def build_zero1_optimizer(model: torch.nn.Module, ocfg, device: torch.device) -> ZeroRedundancyOptimizer:
    """ZeroRedundancyOptimizer over the run's parameter groups (the first passed to the constructor, the rest
    added; empty groups, a LoRA run's, were left out by the builders)."""
    if ocfg.name == "muon":  # ZeRO partitions whole parameters: each rank orthogonalises the matrices it owns
        from loom.optim.build import muon_defaults, muon_param_groups
        from loom.optim.muon import Muon

        groups, cls, kw = muon_param_groups(model, ocfg), Muon, muon_defaults(ocfg)
    else:
        impl = resolve_impl(ocfg.impl, device)
        groups, cls = param_groups(model, ocfg.weight_decay), torch.optim.AdamW
        kw = dict(lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps)
        kw["fused" if impl == "torch-fused" else "foreach"] = impl in ("torch-fused", "torch-foreach")
    first, *rest = groups
    opt = ZeroRedundancyOptimizer(
        first["params"], optimizer_class=cls, **kw, **{k: v for k, v in first.items() if k != "params"}
    )
    for group in rest:
        opt.add_param_group(group)
    return opt
