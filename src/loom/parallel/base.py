"""What the trainer asks of a data-parallel implementation, with the one-process answers as defaults.

Implementations (DDP, FSDP2, ZeRO-1, MPI) override what differs. Checkpoints always hold full, unsharded
state in torch's ordinary format, so a run saved under one implementation and world size resumes under any
other, and `loom generate` reads any run.
"""

from __future__ import annotations

import contextlib

import torch

from loom.optim.build import build_optimizer


class DataParallel:
    """Data parallelism of size 1: the model as it is, sums as they are."""

    rank, size = 0, 1
    sharded = False  # True when a forward pass needs every rank (FSDP): sampling then runs on all ranks
    pipelined = False  # True when the model is cut into pipeline stages (the trainer calls pipeline_step)

    @property
    def world_size(self) -> int:
        """Processes in the job (data-parallel size times the model-parallel degrees)."""
        return self.size

    @property
    def is_main(self) -> bool:
        """The rank that logs and writes files."""
        return self.rank == 0

    def describe(self) -> str:
        return f"dp {self.size}"

    def loss_context(self):
        """Around forward and backward (tensor parallel's loss_parallel)."""
        return contextlib.nullcontext()

    def eval_model(self, raw: torch.nn.Module, wrapped: torch.nn.Module) -> torch.nn.Module:
        """The module validation calls: the unwrapped model, unless the wrapper is what makes it work."""
        return raw

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """The global gradient norm (before clipping); gradients scaled down to max_norm when above it."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor parameters (FSDP)

    def mean_loss(self, t: torch.Tensor) -> torch.Tensor:
        """The mean over data-parallel replicas of each one's loss."""
        return self.all_reduce_sum(t) / self.size

    def sampling_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The model this rank samples with, or None (called on every rank; may be a collective)."""
        return model if self.rank == 0 or self.sharded else None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def build_optimizer(self, model: torch.nn.Module, ocfg, device: torch.device) -> torch.optim.Optimizer:
        return build_optimizer(model, ocfg, device)

    def no_sync(self, model: torch.nn.Module, skip: bool):
        """Within it, backward accumulates gradients without communicating (all micro-steps but the last)."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Hook for implementations that synchronise gradients by hand (MPI)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Make every rank's parameters equal to rank 0's (a no-op for one process)."""

    def broadcast_object(self, obj):
        """Rank 0's Python object on every rank."""
        return obj

    # Checkpoint state: full tensors, torch's formats. Called on every rank; only rank 0's result is saved.
    def model_state(self, model: torch.nn.Module) -> dict:
        return model.state_dict()

    def load_model_state(self, model: torch.nn.Module, sd: dict) -> None:
        model.load_state_dict(sd)

    def optim_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
        return opt.state_dict()

    def load_optim_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
        opt.load_state_dict(sd)


def local_bytes(tensors) -> int:
    """Bytes this rank holds for these tensors (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def model_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state actually held by this rank."""
    params = list(model.parameters())
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its local shard in .optim
    states = [
        v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params),
        "optim": local_bytes(states),
    }
