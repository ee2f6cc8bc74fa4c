"""Expert parallelism: a MoE layer's routed experts split over `ep` ranks, each token sent to its experts'
ranks and back with all-to-all (GShard, Lepikhin et al. 2020; torchtitan's ExpertParallel).

The ranks. Expert parallelism borrows the data-parallel x cp ranks of one (pp, tp) coordinate, as torchtitan
does: those D = dp x cp ranks hold different tokens and (without ep) the same experts. Their flattened index
d (dp_replicate, dp_shard, cp: outermost first) is split as d = efsdp_index * ep + ep_index: the ep innermost
(neighbouring) ranks form an expert-parallel group and split the E experts (E / ep each, in order), and the
D / ep groups hold the same experts: `efsdp`, the dimension expert parameters are data-parallel over
(FSDP-sharded under dp_impl=fsdp/zero2, replicated under ddp). The job's mesh for this is its own DeviceMesh
(pp, efsdp, ep, tp), so an expert weight is a DTensor sharded Shard(0) over "ep" that FSDP shards over
"efsdp" (two dimensions of one mesh, as FSDP + tensor parallel are).

A forward (per MoE layer): the router runs on every rank for its own tokens (the router is replicated, and
routing is fp32 arithmetic on the same weights: each token is routed as one process routes it). The rows
grouped by global expert (`MoE.forward`) go out in ep chunks, one per rank; first the counts (one all-to-all of
E integers, so every rank knows how many rows it receives for each of its experts), then the rows (an
all-to-all with those split sizes). The received rows, ordered by source rank then expert, are regrouped by
expert, run through the local experts' grouped GEMM, put back in received order and returned by the reverse
all-to-all. Backward is the same two all-to-alls of the gradients (functional collectives' autograd all-to-all).

Gradients. An expert's gradient on its rank sums every source rank's contribution (the all-to-all's
backward); the data-parallel wrappers average the other parameters' gradients over the D ranks, so the
expert ones are summed over efsdp and divided by D: FSDP's reduce-scatter over efsdp then a factor, or under
ddp (which ignores them) one all-reduce per expert weight over efsdp (`sync_expert_grads`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.config.layout import ParallelDims
from loom.parallel.tensor import local


def build_ep_mesh(dims: ParallelDims, device_type: str):
    """The (pp, efsdp, ep, tp) mesh of the job's ranks (every rank builds it: its groups are collectives)."""
    from torch.distributed.device_mesh import DeviceMesh

    data = dims.dp * dims.cp
    ranks = torch.arange(dims.world_size).reshape(dims.pp, data // dims.ep, dims.ep, dims.tp)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "efsdp", "ep", "tp"))


class Dispatch:
    """MoE.dispatch under expert parallelism: rows grouped by global expert -> the experts' outputs, in order."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        from loom.compat import all_to_all_single_autograd as all_to_all

        ep = self.size
        per_rank = counts.numel() // ep  # experts per rank
        received = torch.empty_like(counts)  # (ep * per_rank): each source's rows for each of my experts
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(ep, per_rank).sum(1).tolist()  # rows to each rank
        got = received.view(ep, per_rank)
        recv = got.sum(1).tolist()  # rows from each rank
        rows = all_to_all(xs, recv, send, self.group)
        # received order: by source, then expert; the grouped GEMM wants by expert (then source)
        expert = torch.arange(per_rank, device=xs.device).repeat(ep).repeat_interleave(got.flatten())
        by_expert = torch.argsort(expert, stable=True)
        out = experts(rows[by_expert], got.sum(0))[torch.argsort(by_expert)]
        return all_to_all(out, send, recv, self.group)


def apply_ep(layers: list[nn.Module], mesh) -> None:
    """Shard each MoE layer's experts over mesh["ep"] (Shard(0): E / ep whole experts per rank, no
    communication: a meta-built model is sharded before it is materialized) and give it the all-to-all
    dispatch. Their gradients are synchronised apart (the module docstring)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh = mesh["ep"]
    for moe in layers:
        experts = moe.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            sharded = nn.Parameter(
                distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None), p.requires_grad
            )
            setattr(experts, name, sharded)
        moe.dispatch = Dispatch(ep_mesh.get_group(), ep_mesh.size())


def shard_experts(layers: list[nn.Module], mesh, **fsdp_kw) -> None:
    """FSDP over efsdp for each layer's experts (before the blocks', which then leave them alone). Its
    reduce-scatter averages over efsdp; sync_expert_grads makes that the mean over all D ranks."""
    from torch.distributed.fsdp import fully_shard

    for moe in layers:
        fully_shard(moe.experts, mesh=mesh["efsdp"], **fsdp_kw)


def sync_expert_grads(params: list[nn.Parameter], mesh, data_ranks: int, fsdp: bool) -> None:
    """After the last backward of a step, each expert gradient made the mean over the D data-parallel x cp
    ranks of their contributions: under FSDP (which averaged over efsdp = D / ep) a factor 1 / ep; under ddp
    (which ignores the expert weights) a sum over efsdp, divided by D. (FSDP's own divide factor would do the
    first in the reduce-scatter, but takes a premultiplied sum that gloo has not.)"""
    group = mesh["efsdp"].get_group() if mesh["efsdp"].size() > 1 and not fsdp else None
    scale = 1.0 / mesh["ep"].size() if fsdp else 1.0 / data_ranks
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            if group is not None:
                dist.all_reduce(g, group=group)
            g.mul_(scale)
