"""How loom.parallel applies to the MoE family: GPT's plan (gpt_parallel.py) with the MoE layers' own parts.

Tensor parallel: attention is split as in the GPT; a MoE layer is not (its experts are not TP-sharded). Each
tensor-parallel rank runs the MoE layer on the whole (replicated, or with sequence parallel gathered) hidden
states of its data-parallel rank, so the tp ranks repeat the same routing and expert work; expert parallelism
(loom.parallel.expert) is what splits the experts, over the data-parallel ranks. Megatron's expert-tensor
parallelism (experts' own matrices split over tp) is not built.

Expert parallelism and the balance step (`after_step`) live here too: the parallel package asks the family
which modules are expert layers (`experts`) and calls `after_step` after each optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from loom.model.gpt import gpt_parallel
from loom.model.gpt.gpt_parallel import blocks, retie, split_stages, stage_layers, tied  # noqa: F401 (the plan)
from loom.model.moe.moe import MoE, MoEGPT


def tp_plan(model: MoEGPT, tp: int, sp: bool, loss_parallel: bool) -> dict:
    """GPT's plan without the MLP entries of MoE layers; with sequence parallel a MoE layer takes the gathered
    sequence (as the dense MLP's input) and gives back this rank's shard of it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    plan = gpt_parallel.tp_plan(model, tp, sp, loss_parallel)
    for i in model.cfg.moe_layers:
        mlp = f"blocks.{i}.mlp"
        for k in [k for k in plan if k.startswith(mlp + ".")]:
            del plan[k]
        if sp:
            plan[mlp] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=True,
            )
    return plan


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """{layer index: MoE} of the layers this model (or pipeline stage) holds."""
    return {int(n.split(".")[1]): m for n, m in model.named_modules() if isinstance(m, MoE)}


def expert_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers this model (or pipeline stage) holds: expert parallelism splits their experts."""
    return list(moe_layers(model).values())


def after_step(model: nn.Module, sum_all: Callable[[torch.Tensor], torch.Tensor], update: bool) -> dict:
    """After an optimizer step (update: it was taken, not skipped): each MoE layer's load over the global batch
    (one sum over every rank of the job: a layer's loads come from the ranks that hold it, each counted tp
    times, which neither the sign of the bias update nor a max/mean ratio sees), its bias moved, and the
    per-layer figures for metrics.jsonl: tokens per expert max/mean, the balance loss, the bias norm."""
    layers = moe_layers(model)
    if not layers:
        return {}
    cfg = next(iter(layers.values()))
    n_layer, E = model.cfg.n_layer, cfg.n_experts
    device = cfg.router.weight.device
    table = torch.zeros(n_layer, E + 2, device=device)  # load (E), balance-loss sum, its count
    for i, m in layers.items():
        table[i] = m.stats(E, device)
    table = sum_all(table)
    out: dict = {}
    ratios = []
    for i, m in layers.items():
        load, (aux, n) = table[i, :E], table[i, E:].tolist()
        figures = m.balance_step(load, update)
        ratios.append(figures["max_mean"])
        out[f"moe/{i}/max_mean"] = figures["max_mean"]
        out[f"moe/{i}/bias_norm"] = figures["bias_norm"]
        if n:
            out[f"moe/{i}/balance"] = aux / n
    out["moe/max_mean"] = max(ratios)
    return out
