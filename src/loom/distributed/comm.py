"""The control plane: the one place that issues loom's own small collectives.

Config agreement, the run plan chosen by rank 0, stop and non-finite flags, the checkpoint outcome: a few
numbers or a Python object, never a model tensor. They always travel as CPU values, so on a GPU job they go
through the group's gloo backend (`process_group.backend_for`) and never queue behind the GPU's stream;
callers pass Python values, so no caller can hand NCCL a CPU tensor or gloo a CUDA one. Model-sized
collectives (gradients, parameters) belong to loom.parallel and run on the job's device.

Three implementations of one narrow interface: one process, torch.distributed, and MPI (mpi4py, for
`parallel.dp_impl=mpi`, which has no torch process group).
"""

from __future__ import annotations

from typing import Any


class Control:
    """One process: every collective is the identity."""

    rank, size = 0, 1

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """The element-wise sum of `values` over all ranks."""
        return list(values)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's Python object on every rank."""
        return obj

    def barrier(self) -> None:
        """Wait until every rank arrives."""

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's Python object, in rank order, on rank 0; None elsewhere."""
        return [obj]


class TorchControl(Control):
    """The control plane on the job's torch.distributed default group (CPU tensors: gloo)."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self.group = group  # None: the default group; a background checkpoint save gets its own gloo group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device="cpu")
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def broadcast_object(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, device="cpu", group=self.group)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def gather_object(self, obj: Any) -> list[Any] | None:
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out


class MpiControl(Control):
    """The control plane over an mpi4py communicator."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        import numpy as np
        from mpi4py import MPI

        arr = np.asarray(values, dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
        return arr.tolist()

    def broadcast_object(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather_object(self, obj: Any) -> list[Any] | None:
        return self.comm.gather(obj, root=0)
