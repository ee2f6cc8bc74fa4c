"""Timing collectives for `loom bench comm` (layer 6): the three backends and the nccl-tests formulas.

Backends, each behind the same small `Comm` interface:

* `torch`: torch.distributed (gloo on CPU, NCCL on CUDA), env:// rendezvous from `loom.env`.
* `mpi`: mpi4py's built-ins (Allreduce, Allgather, Reduce_scatter_block, Bcast), out of place.
* `ring`: loom's collectives from point-to-point messages (`loom.parallel.collectives`).

Measured as nccl-tests does (its doc/PERFORMANCE.md): `warmup` untimed calls, a barrier, `iters`
timed calls; time = the slowest rank's mean per call. `bytes` is the largest buffer: the all-reduce
and broadcast buffer, the gathered output of all-gather, the input of reduce-scatter (each rank
contributes or keeps bytes / n). algbw = bytes / time; busbw = algbw × 2(n-1)/n for all-reduce,
× (n-1)/n for all-gather and reduce-scatter, × 1 for broadcast: the traffic of one link in a
bandwidth-optimal algorithm, comparable across ops and world sizes. GB/s means 10^9 bytes/s, as in
nccl-tests.

Buffers hold zeros: in-place ops (torch all_reduce, every ring op) keep reducing their own output,
and zeros can neither overflow nor turn denormal, which would change the speed of the arithmetic.
torch, numpy and mpi4py are imported inside the functions that need them.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loom.env import detect_env, free_port
from loom.errors import LoomError

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
TIMEOUT_S = 300.0  # per collective; a 256 MB all-reduce on gloo takes about a second


# ------------------------------------------------------------------------------------------ formulas


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio for `op` on `world_size` ranks."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n  # reduce-scatter then all-gather: each rank sends 2(n-1)/n of the buffer
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n  # each rank sends (or receives) all blocks but its own
    return 1.0  # broadcast: every byte crosses at least one link


def element_count(op: str, size: int, itemsize: int, world_size: int) -> int:
    """Elements in the op's largest buffer for a requested size in bytes.

    All-gather and reduce-scatter need n equal blocks, so their count is rounded down to a multiple of
    the world size (as nccl-tests does), and at least one element per rank.
    """
    count = max(1, size // itemsize)
    if op in ("all_gather", "reduce_scatter"):
        count = max(world_size, count - count % world_size)
    return count


def record(backend: str, op: str, nbytes: int, world_size: int, seconds: float, dtype: str) -> dict[str, Any]:
    """One result as written to --json: time in microseconds, bandwidths in 10^9 bytes per second."""
    algbw = nbytes / seconds / 1e9
    return {
        "backend": backend,
        "op": op,
        "bytes": nbytes,
        "world_size": world_size,
        "dtype": dtype,
        "time_us": seconds * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor(op, world_size),
    }


# ------------------------------------------------------------------------------------------ backends


def _nothing() -> None:
    pass


@dataclass
class Comm:
    """A backend ready to run: its place in the job and how to time a collective on it."""

    rank: int
    world_size: int
    prepare: Callable[[str, int], Callable[[], Any]]  # (op, elements of the largest buffer) → one call
    barrier: Callable[[], Any]
    slowest: Callable[[float], float]  # the maximum of a per-rank value
    sync: Callable[[], Any] = _nothing  # wait for queued device work (CUDA)
    close: Callable[[], Any] = _nothing


def require_mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise LoomError(
            "mpi4py is not installed (needed by --backend mpi and ring)", hint="pip install 'loom[mpi]'"
        ) from e
    return MPI


def mpi_comm(backend: str, dtype: str) -> Comm:
    """mpi4py's built-in collectives (backend "mpi") or loom's ring ones ("ring") on COMM_WORLD."""
    import numpy as np

    from loom.parallel import collectives as coll

    MPI = require_mpi()
    comm = MPI.COMM_WORLD
    n, dt = comm.Get_size(), coll.mpi_dtype(dtype)

    def prepare(op: str, count: int) -> Callable[[], Any]:
        full, part = np.zeros(count, dtype=dtype), np.zeros(count // n, dtype=dtype)
        if backend == "ring":
            return {
                "all_reduce": lambda: coll.ring_allreduce(comm, full),
                "all_gather": lambda: coll.allgather(comm, part, full),
                "reduce_scatter": lambda: coll.ring_reduce_scatter(comm, full),
                "broadcast": lambda: coll.broadcast(comm, full, root=0),
            }[op]
        out = np.empty_like(full) if op == "all_reduce" else None  # out of place, nccl-tests' default
        return {
            "all_reduce": lambda: comm.Allreduce([full, dt], [out, dt], op=MPI.SUM),
            "all_gather": lambda: comm.Allgather([part, dt], [full, dt]),
            "reduce_scatter": lambda: comm.Reduce_scatter_block([full, dt], [part, dt], op=MPI.SUM),
            "broadcast": lambda: comm.Bcast([full, dt], root=0),
        }[op]

    return Comm(comm.Get_rank(), n, prepare, comm.Barrier, lambda t: comm.allreduce(t, op=MPI.MAX))


def _agree_on_port(env) -> None:
    """Under mpiexec with no MASTER_PORT, rank 0 picks a free port and tells the others through MPI."""
    if os.environ.get("MASTER_PORT") or env.source not in ("openmpi", "mpich/pmi"):
        return
    if importlib.util.find_spec("mpi4py") is None:
        return  # keep loom.env's default port
    comm = require_mpi().COMM_WORLD
    os.environ["MASTER_PORT"] = str(comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0))


def torch_comm(dtype: str, device_arg: str) -> Comm:
    """torch.distributed collectives: gloo on CPU, NCCL on CUDA (one GPU per local rank)."""
    import torch
    import torch.distributed as dist

    from loom import device as dev
    from loom.distributed import process_group

    env = detect_env()
    if device_arg == "cuda" and not dev.available("cuda"):
        raise LoomError("--device cuda, but torch sees no CUDA device", hint="use --device cpu (gloo)")
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and dev.available("cuda"))
    device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
    _agree_on_port(env)
    process_group.init(env, device, TIMEOUT_S)
    tdtype, n = getattr(torch, dtype), dist.get_world_size()
    # torch 2.13 renamed the single-tensor gather / scatter and deprecates the old names.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def prepare(op: str, count: int) -> Callable[[], Any]:
        full = torch.zeros(count, dtype=tdtype, device=device)
        part = torch.zeros(count // n, dtype=tdtype, device=device)
        return {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: all_gather(full, part),
            "reduce_scatter": lambda: reduce_scatter(part, full),
            "broadcast": lambda: dist.broadcast(full, src=0),
        }[op]

    def slowest(t: float) -> float:
        x = torch.tensor([t], dtype=torch.float64, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x.item())

    sync = (lambda: dev.synchronize(device)) if use_cuda else _nothing
    return Comm(dist.get_rank(), n, prepare, dist.barrier, slowest, sync, process_group.shutdown)


def bench(
    comm: Comm, backend: str, ops: list[str], sizes: list[int], dtype: str, iters: int, warmup: int
) -> list[dict[str, Any]]:
    """Time every op at every size on one backend; every rank returns the same records."""
    records = []
    for op in ops:
        for size in sizes:
            count = element_count(op, size, ITEMSIZE[dtype], comm.world_size)
            call = comm.prepare(op, count)
            for _ in range(warmup):
                call()
            comm.sync()
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            comm.sync()
            seconds = comm.slowest((time.perf_counter() - start) / iters)
            records.append(record(backend, op, count * ITEMSIZE[dtype], comm.world_size, seconds, dtype))
            del call  # free this size's buffers before the next ones are allocated
    return records
