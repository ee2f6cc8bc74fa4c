"""The trainer's DataParallel value for `parallel.dp_impl=mpi`: mpi4py only, no torch.distributed.

Rank 0's parameters are broadcast at start and after loading a checkpoint; each rank reads its slice
of the global batch; gradients are averaged by the synchroniser chosen with `parallel.mpi_sync`
(naive: one Allreduce per parameter; bucketed: Iallreduce per bucket from gradient hooks, overlapping
backward) only on the last micro-step of an accumulation.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from loom import log
from loom.errors import LoomError
from loom.parallel.base import DataParallel
from loom.parallel.mpi_dp import BucketedSync, NaiveSync, broadcast_state, cuda_aware_mpi, mpi_comm


class MpiDP(DataParallel):
    def __init__(self, sync: str, bucket_mb: float, allreduce: str):
        if sync not in ("naive", "bucketed"):
            raise LoomError(f"unknown parallel.mpi_sync '{sync}'", hint="use naive or bucketed")
        if bucket_mb <= 0:
            raise LoomError(
                f"parallel.bucket_mb must be > 0, got {bucket_mb}", hint="e.g. 25 (DDP's default)"
            )
        self.comm = mpi_comm()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.kind, self.bucket_mb, self.allreduce = sync, bucket_mb, allreduce
        self.sync: NaiveSync | BucketedSync | None = None
        if self.size == 1:
            log.warn("parallel.dp_impl=mpi with one process (not started by mpiexec?): training alone")

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.kind == "naive":
            self.sync = NaiveSync(model, self.comm)
        else:
            self.sync = BucketedSync(model, self.comm, self.bucket_mb, self.allreduce)
        gpu = next(model.parameters()).is_cuda
        if gpu:
            log.info(f"MPI {'is' if cuda_aware_mpi() else 'is not'} CUDA-aware: gradients "
                     f"{'go directly from' if cuda_aware_mpi() else 'are staged through host memory from'} the GPU")  # fmt: skip
        return model

    def no_sync(self, model: torch.nn.Module, skip: bool):
        return self.sync.no_sync() if skip and self.sync is not None else contextlib.nullcontext()

    def after_backward(self) -> None:
        self.sync.sync()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        from mpi4py import MPI

        host = t.detach().to("cpu", copy=True).contiguous()
        arr = host.numpy()
        self.comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
        return torch.from_numpy(np.ascontiguousarray(arr)).to(t.device)

    def broadcast_model(self, model: torch.nn.Module) -> None:
        broadcast_state(model, self.comm)

    def broadcast_object(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)
