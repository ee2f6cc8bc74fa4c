"""LoRA adapters under tensor parallelism: each adapted linear's style places lora_A and lora_B as Megatron's
(and peft's Megatron) LoRA does, so no rank holds or computes more than its share.

A column-parallel linear (output features split): A (rank, in) replicated, B (out, rank) split by rows with the
weight, so a rank's delta x A^T B_r^T is its own output shard; A's gradient is a partial sum over the ranks,
reduced with the other replicated parameters' (loom.parallel.tensor.align_grads). A row-parallel linear (input
features split): A split by columns with the weight, B replicated; x_r A_r^T is a partial sum, which the output's
reduction adds up with the base's. torch's stock styles would shard A along its rank dimension (colwise) or
replicate both (rowwise): the same numbers, more memory and work.
"""

from __future__ import annotations

import copy
import functools

import torch.nn as nn

from loom import compat
from loom.model.lora import LoRALinear


def lora_tp_styles(model: nn.Module, plan: dict) -> dict:
    """The tensor-parallel plan with each adapted linear's Colwise/RowwiseParallel placing its adapters."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for path, style in plan.items():
        module = model.get_submodule(path) if path else model
        if isinstance(module, LoRALinear) and isinstance(style, (ColwiseParallel, RowwiseParallel)):
            style = copy.copy(style)
            style.__class__ = _lora_style(type(style))
        out[path] = style
    return out


@functools.cache  # one subclass per style class
def _lora_style(cls: type) -> type:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    colwise = issubclass(cls, ColwiseParallel)
    places = {"lora_A": Replicate() if colwise else Shard(1), "lora_B": Shard(0) if colwise else Replicate()}

    def partition(base, self, name, module, mesh):
        params = compat.module_parameters(module)
        adapters = {n: params.pop(n) for n in places}  # the base style sees weight and bias only
        base(self, name, module, mesh)
        for n, p in adapters.items():
            d = distribute_tensor(p, mesh, [places[n]], src_data_rank=self.src_data_rank)
            module.register_parameter(n, nn.Parameter(d, requires_grad=p.requires_grad))

    return compat.style_partitioning_linear(cls, f"LoRA{cls.__name__}", partition)
