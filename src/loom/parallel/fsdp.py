"""Sharded data parallelism with FSDP2 (`fully_shard`): ZeRO-2, ZeRO-3 and HSDP.

`fully_shard` is applied to every transformer block and then to the root (the embeddings, the final norm and
the tied head), as torchtitan does: each block's parameters are all-gathered just before its forward/backward
and its gradients reduce-scattered just after, so only one block is ever whole. ZeRO-3 (`fsdp`) frees the
gathered parameters after forward (reshard_after_forward=True); ZeRO-2 (`zero2`) keeps them until backward,
trading memory for one all-gather less (Rajbhandari et al., 2020).

HSDP: on a 2-D mesh (dp_replicate, dp_shard) parameters are sharded within a replica group and replicated
across groups; gradients are reduce-scattered within a group, then all-reduced across groups. With
dp_shard = 1 that is plain replicated data parallel, which is how tensor/pipeline layouts get `ddp` for
their data-parallel dimension.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from loom import log
from loom.config import check_choice
from loom.metrics import DTYPES, check_bf16


def mp_policy(param_dtype: str, reduce_dtype: str, device: torch.device, precision: str):
    """FSDP's mixed precision. Empty param_dtype: bf16 on GPUs when training in bf16 (the gathered copies
    and the compute are bf16, half the all-gather bytes), else as stored; empty reduce_dtype: fp32, so
    gradients are summed at full precision (torchtitan's default). On CPUs both stay fp32 unless asked."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    check_choice("parallel.param_dtype", param_dtype)
    check_choice("parallel.reduce_dtype", reduce_dtype)
    if param_dtype == "bf16":
        check_bf16(device, "parallel.param_dtype")
    if not param_dtype and device.type == "cuda" and precision == "bf16":
        param_dtype = "bf16"
    if not reduce_dtype and param_dtype and param_dtype != "fp32":
        reduce_dtype = "fp32"
    return MixedPrecisionPolicy(param_dtype=DTYPES.get(param_dtype), reduce_dtype=DTYPES.get(reduce_dtype))


def apply_fsdp(
    roots: list[nn.Module],
    units_of,
    mesh,
    reshard_after_forward: bool,
    mp,
    cpu_offload: bool,
    device: torch.device,
) -> None:
    """fully_shard every unit (transformer block) of each root, then the root itself."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": mp}
    if cpu_offload and device.type == "cpu":
        log.warn("parallel.cpu_offload has no effect on a CPU device; ignored")
    elif cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for root in roots:
        for unit in units_of(root):
            fully_shard(unit, **kw)
        fully_shard(root, **kw)


def set_gradient_sync(roots: list[nn.Module], last: bool, sharded: bool) -> None:
    """Gradient accumulation: what a micro-step's backward communicates (`last`: the step's final one).

    Sharded (dp_shard x cp > 1): every micro-step reduce-scatters, as torchtitan does, and only HSDP's all-reduce
    across replicas waits for the last. Skipping the reduce-scatter too would keep each block's gradients
    unsharded, in the reduce dtype, from the first micro-step to the last: the whole model's gradients on
    every rank (a Llama-3-70B rank of tp 8 x fsdp 64 held 37 GiB of them, 405B's 198 GiB), the memory FSDP
    exists to save. The sharded gradients accumulate in `.grad` instead. Replicated only (dp_shard x cp = 1, tensor
    or pipeline layouts' data-parallel degree): a block's unsharded gradient is its whole local gradient
    either way, so all micro-steps but the last skip the sync."""
    for root in roots:
        if sharded:
            root.set_requires_gradient_sync(True)
            root.set_requires_all_reduce(last)
        else:
            root.set_requires_gradient_sync(last)
