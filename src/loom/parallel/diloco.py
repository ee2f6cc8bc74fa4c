"""DiLoCo: data parallelism that communicates once every H steps (Douillard et al. 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models").

Each replica (the ranks of one dp_replicate index: a node, ddp or fsdp inside it) trains on its own share of
every global batch with its own inner optimizer (loom's AdamW/Muon) for H = parallel.diloco_inner_steps steps;
then every rank takes one outer step: the change since the last outer step (anchor - params, the "outer
gradient") is averaged over the replicas in one all-reduce, and the anchor moves by Nesterov SGD on it
(outer_lr, outer_momentum; the paper's 0.7 and 0.9); the parameters become the new anchor. Communication
across the replicate dimension: the parameters once per H steps instead of the gradients every step.

Every rank holds the anchor and the momentum of its own pieces (FSDP: its shard, the same shard on the same
shard rank of every replica). Inner optimizer states stay per replica, as in the paper. Checkpoints are
written after outer steps only (validate keeps train.steps and ckpt_every multiples of H), where every replica
holds the same parameters: the model is saved once, the momentum beside the optimizer state, and each
replica's inner optimizer state under its own key prefix (`inner_prefix`).

Why not torchft's DiLoCo: torchft is built around its own fault-tolerant process groups and Manager (a
lighthouse server, quorum per step), which is a different job model from loom's launch and checkpoint
(DCP folders written by loom's own checkpointer); what loom needs of it is the outer step, ~60 lines here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.config.layout import ParallelDims
from loom.parallel.init import canonical
from loom.parallel.tensor import is_dtensor, local


def replica_groups(dims: ParallelDims, mesh=None):
    """(the ranks of this rank's replica, the ranks holding the same piece in every replica) as process
    groups; None for a group of one rank. FSDP's mesh has both; a ddp job creates them here (every rank
    creates every group, in the same order, as torch.distributed requires)."""
    if dims.world_size == 1:
        return None, None
    if mesh is not None:
        return mesh["dp_shard"].get_group(), mesh["dp_replicate"].get_group()
    R, S = dims.dp_replicate, dims.dp_shard
    mine = [None, None]
    for r in range(R):
        ranks = [r * S + s for s in range(S)]
        g = dist.new_group(ranks)
        mine[0] = g if dims.rank in ranks else mine[0]
    for s in range(S):
        ranks = [r * S + s for r in range(R)]
        g = dist.new_group(ranks)
        mine[1] = g if dims.rank in ranks else mine[1]
    return mine[0], mine[1]


class DiLoCo:
    """The outer loop over `model`'s trained parameters (after parallelize: the objects FSDP made)."""

    def __init__(
        self,
        model: nn.Module,
        dims: ParallelDims,
        group,
        inner_steps: int,
        lr: float,
        momentum: float,
        aliases: dict[str, str],
    ):
        self.h, self.lr, self.mu = inner_steps, lr, momentum
        self.dims, self.group = dims, group
        # single-device names (checkpoint keys: a wrapper's prefixes and a tied alias go)
        self.named = [(canonical(n, aliases), p) for n, p in model.named_parameters() if p.requires_grad]
        self.anchor: list[torch.Tensor] = []
        self.momentum = [torch.zeros_like(local(p)) for _, p in self.named]
        # the replicas' mean of the outer gradient from outside, in place, and whether to apply it (torchft:
        # the replicas are ft replica groups, loom.distributed.ft); None: the all-reduce over `group`
        self.outer_mean: Callable[[torch.Tensor], bool] | None = None
        self.reanchor()

    @property
    def inner_prefix(self) -> str:
        """The key prefix of this replica's inner optimizer state in a checkpoint (replica 0: none, so a
        checkpoint resumes under one process or plain data parallel with replica 0's state)."""
        r = self.dims.dp_replicate_rank
        return f"diloco_replica{r}." if r else ""

    def reanchor(self) -> None:
        """The anchor becomes the parameters as they are (at start, after a checkpoint or weights are loaded)."""
        self.anchor = [local(p).detach().clone() for _, p in self.named]

    def due(self, step: int) -> bool:
        return step % self.h == 0

    @torch.no_grad()
    def outer_step(self) -> int:
        """Average the change since the anchor over the replicas, one Nesterov step of the anchor, parameters
        set to it. Returns the bytes this rank all-reduced."""
        delta = torch.cat(
            [(a - local(p)).flatten() for a, (_, p) in zip(self.anchor, self.named, strict=True)]
        )
        n = dist.get_world_size(self.group) if self.group is not None else 1
        if self.outer_mean is not None:
            if not self.outer_mean(delta):  # not committed (a replica failed in it): the window is undone
                for a, (_, p) in zip(self.anchor, self.named, strict=True):
                    local(p).copy_(a)
                return 0
        elif n > 1:
            dist.all_reduce(delta, group=self.group)
            delta /= n
        offset = 0
        for a, m, (_, p) in zip(self.anchor, self.momentum, self.named, strict=True):
            d = delta[offset : offset + a.numel()].view_as(a)
            offset += a.numel()
            m.mul_(self.mu).add_(d)  # torch.optim.SGD's buffer (dampening 0)
            a.sub_(d.add(m, alpha=self.mu) if self.mu else d, alpha=self.lr)  # Nesterov: d + mu * m
            local(p).copy_(a)
        sent = n > 1 or self.outer_mean is not None
        return delta.numel() * delta.element_size() if sent else 0

    def momentum_state(self) -> dict[str, torch.Tensor]:
        """{"diloco.momentum.<name>": this rank's piece} for a checkpoint (DTensors where the parameter is one,
        so DCP records each shard's place)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for m, (name, p) in zip(self.momentum, self.named, strict=True):
            if is_dtensor(p):
                m = DTensor.from_local(m, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            out[f"diloco.momentum.{name}"] = m
        return out
