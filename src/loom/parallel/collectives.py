"""Collective operations written from point-to-point messages on an mpi4py communicator (layer 3).

The collectives of parallel training (broadcast, reduce, scatter, all-gather, reduce-scatter and
all-reduce), built only from `Send` / `Recv` / `Sendrecv`, so that each algorithm can be read and
checked against MPI's own implementation:

* `ring_allreduce` = `ring_reduce_scatter` + a ring all-gather (Patarasuk & Yuan, "Bandwidth optimal
  all-reduce algorithms for clusters of workstations", JPDC 2009; popularised for deep learning by
  Baidu's ring all-reduce, Gibiansky 2017). Each rank sends 2·(p-1)/p·n elements: bandwidth-optimal.
* `broadcast`, `reduce` and `scatter` use binomial trees (Thakur, Rabenseifner & Gropp, "Optimization
  of collective communication operations in MPICH", IJHPCA 2005): ceil(log2 p) rounds.
* `allgather` is the ring all-gather on equal blocks.

Buffers are numpy arrays or CPU torch tensors (used through their `.numpy()` view, so in-place
results land in the tensor). Supported dtypes: float16, float32, float64, int32, int64. Reductions
accumulate in the buffer's own dtype, as MPI does (float16 sums are rounded to float16 at every step).
Every rank must call a collective with the same element count, dtype, op and root.

mpi4py is never imported at module level (house rule: no import-time side effects).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loom.errors import LoomError

# One tag per collective, so that messages of different collectives can never be matched to each other.
TAG_REDUCE_SCATTER = 7101
TAG_ALLGATHER = 7102
TAG_BROADCAST = 7103
TAG_REDUCE = 7104
TAG_SCATTER = 7105

_MPI_TYPE_NAMES = {
    "float16": "FLOAT16_T",  # MPIX_C_FLOAT16 in MPICH; mpi4py >= 4.0 names it FLOAT16_T
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "int32": "INT32_T",
    "int64": "INT64_T",
}
_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
_SUPPORTED = ", ".join(_MPI_TYPE_NAMES)


def mpi_dtype(dtype: Any) -> Any:
    """The `MPI.Datatype` for a numpy dtype, a dtype name or a torch dtype (e.g. torch.float32)."""
    from mpi4py import MPI

    try:
        name = np.dtype(dtype).name
    except TypeError:  # torch dtypes and names numpy does not know (bfloat16)
        name = str(dtype).removeprefix("torch.")
    if name not in _MPI_TYPE_NAMES:
        raise LoomError(
            f"dtype {dtype} is not supported by loom's collectives", hint=f"use one of {_SUPPORTED}"
        )
    mpi_type = getattr(MPI, _MPI_TYPE_NAMES[name], MPI.DATATYPE_NULL)
    if mpi_type == MPI.DATATYPE_NULL:
        raise LoomError(
            f"this MPI / mpi4py has no {name} datatype",
            hint="pip install 'mpi4py>=4' with an MPI that has MPIX_C_FLOAT16 (MPICH >= 4), or use float32",
        )
    return mpi_type


def chunk_sizes(n: int, world_size: int) -> list[int]:
    """Split n elements into world_size chunks; the first n % world_size chunks get one more element.

    The same split as `np.array_split` and `torch.tensor_split`, so sizes not divisible by the world
    size (and n < world_size, where some chunks are empty) need no padding.
    """
    base, extra = divmod(n, world_size)
    return [base + (1 if i < extra else 0) for i in range(world_size)]


def _offsets(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


def _ufunc(op: str) -> np.ufunc:
    if op not in _UFUNCS:
        raise LoomError(f"unknown reduction op {op!r}", hint=f"use one of {', '.join(_UFUNCS)}")
    return _UFUNCS[op]


def _check_root(comm: Any, root: int) -> None:
    if not 0 <= root < comm.Get_size():
        size = comm.Get_size()
        raise LoomError(f"root {root} is not a rank of this communicator", hint=f"use 0 ≤ root < {size}")


def _flat(buf: Any) -> np.ndarray:
    """A flat numpy view sharing memory with `buf` (numpy array or CPU torch tensor)."""
    if not isinstance(buf, np.ndarray):
        if not (hasattr(buf, "detach") and hasattr(buf, "device")):
            raise LoomError(
                f"expected a numpy array or torch tensor, got {type(buf).__name__}",
                hint="wrap it: np.asarray(x)",
            )
        if buf.device.type != "cpu":
            raise LoomError(
                f"loom's collectives run on host memory, got a tensor on {buf.device}",
                hint="stage it through the host: host = t.cpu(); ...; t.copy_(host)",
            )
        try:
            buf = buf.detach().numpy()
        except TypeError as e:  # bfloat16 and other dtypes numpy lacks
            raise LoomError(f"dtype {buf.dtype} has no numpy view", hint=f"use one of {_SUPPORTED}") from e
    if not buf.flags.c_contiguous:
        raise LoomError(
            "collectives need a contiguous buffer", hint="pass np.ascontiguousarray(x) / x.contiguous()"
        )
    mpi_dtype(buf.dtype)  # validates the dtype
    return buf.reshape(-1)


def _chunk(flat: np.ndarray, counts: list[int], offs: list[int], i: int) -> np.ndarray:
    return flat[offs[i] : offs[i] + counts[i]]


def _ring_reduce_scatter(comm: Any, flat: np.ndarray, op: str) -> tuple[list[int], list[int]]:
    """Ring reduce-scatter on a flat array: afterwards chunk `rank` holds the reduction over all ranks.

    At step s (0 ≤ s < p-1) rank r sends chunk (r-s-1) mod p to its right neighbour and receives chunk
    (r-s-2) mod p from its left neighbour, folding it into its own copy. Chunk c starts on rank c+1 and
    travels p-1 hops around the ring, so it ends, complete, on rank c.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    counts = chunk_sizes(flat.size, p)
    offs, ufunc = _offsets(counts), _ufunc(op)
    if p == 1 or flat.size == 0:
        return counts, offs
    dt = mpi_dtype(flat.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    scratch = np.empty(max(counts), dtype=flat.dtype)
    for s in range(p - 1):
        send_c, recv_c = (r - s - 1) % p, (r - s - 2) % p
        incoming = scratch[: counts[recv_c]]
        comm.Sendrecv(
            [_chunk(flat, counts, offs, send_c), dt],
            dest=right,
            sendtag=TAG_REDUCE_SCATTER,
            recvbuf=[incoming, dt],
            source=left,
            recvtag=TAG_REDUCE_SCATTER,
        )
        mine = _chunk(flat, counts, offs, recv_c)
        ufunc(mine, incoming, out=mine)
    return counts, offs


def _ring_allgather(comm: Any, flat: np.ndarray) -> None:
    """Ring all-gather on a flat array whose chunk `rank` is this rank's contribution.

    At step s rank r forwards chunk (r-s) mod p (its own at s=0, then the one it just received) to the
    right and receives chunk (r-s-1) mod p from the left, straight into its place: p-1 steps.
    """
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or flat.size == 0:
        return
    counts = chunk_sizes(flat.size, p)
    offs, dt = _offsets(counts), mpi_dtype(flat.dtype)
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        send_c, recv_c = (r - s) % p, (r - s - 1) % p
        comm.Sendrecv(
            [_chunk(flat, counts, offs, send_c), dt],
            dest=right,
            sendtag=TAG_ALLGATHER,
            recvbuf=[_chunk(flat, counts, offs, recv_c), dt],
            source=left,
            recvtag=TAG_ALLGATHER,
        )


def ring_reduce_scatter(comm: Any, buf: Any, op: str = "sum") -> Any:
    """Ring reduce-scatter, in place (Patarasuk & Yuan 2009, first half of the ring all-reduce).

    `buf` holds this rank's full input of n elements. Afterwards chunk `rank` of `buf` (sizes from
    `chunk_sizes(n, world_size)`, uneven when n % world_size != 0) holds the reduction of that chunk
    over all ranks, and is returned as a view of the same type as `buf`. The other chunks are left
    holding partial reductions (they are the working space). Equals MPI's `Reduce_scatter` with
    `recvcounts=chunk_sizes(n, p)`.
    """
    counts, offs = _ring_reduce_scatter(comm, _flat(buf), op)
    r = comm.Get_rank()
    return buf.reshape(-1)[offs[r] : offs[r] + counts[r]]


def ring_allreduce(comm: Any, buf: Any, op: str = "sum") -> Any:
    """Ring all-reduce, in place: ring reduce-scatter followed by ring all-gather.

    Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations" (JPDC 2009);
    the same algorithm as Baidu's ring all-reduce (Gibiansky 2017) and NCCL's ring. Each rank sends and
    receives 2·(p-1)·n/p elements in 2·(p-1) steps, independent of p for large n. Works for any n
    (uneven chunks when n % p != 0, n = 0, n < p) and for p = 1. Equals MPI's `Allreduce` up to the
    order of floating-point additions. Returns `buf`.
    """
    flat = _flat(buf)
    _ring_reduce_scatter(comm, flat, op)
    _ring_allgather(comm, flat)
    return buf


def broadcast(comm: Any, buf: Any, root: int = 0) -> Any:
    """Binomial-tree broadcast from `root`, in place (MPICH's short-message algorithm, Thakur et al. 2005).

    In ranks relative to the root, rank v receives from v - 2^k (2^k its lowest set bit), then sends
    to v + 2^j for each 2^j < 2^k: ceil(log2 p) rounds, each moving the whole message. Not pipelined,
    so for very large messages scatter + all-gather (van de Geijn) would use less bandwidth. Returns `buf`.
    """
    _check_root(comm, root)
    flat = _flat(buf)
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1 or flat.size == 0:
        return buf
    dt, vr = mpi_dtype(flat.dtype), (r - root) % p
    mask = 1
    while mask < p:
        if vr & mask:
            comm.Recv([flat, dt], source=(vr - mask + root) % p, tag=TAG_BROADCAST)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < p:
            comm.Send([flat, dt], dest=(vr + mask + root) % p, tag=TAG_BROADCAST)
        mask >>= 1
    return buf


def reduce(comm: Any, sendbuf: Any, recvbuf: Any = None, op: str = "sum", root: int = 0) -> Any:
    """Binomial-tree reduce to `root` (Thakur et al. 2005); ops are commutative, so any order is valid.

    In ranks relative to the root, at round k every rank with bit k set sends its partial result to
    the rank 2^k below it and drops out; the others fold in what they receive. On the root the result
    is written to `recvbuf` (a new numpy array of sendbuf's shape if None) and returned; other ranks
    return None. `sendbuf` is not modified.
    """
    _check_root(comm, root)
    src = _flat(sendbuf)
    p, r = comm.Get_size(), comm.Get_rank()
    dt, ufunc, vr = mpi_dtype(src.dtype), _ufunc(op), (r - root) % p
    work = src.copy()
    incoming = np.empty_like(work)
    mask = 1
    while mask < p and work.size:
        if vr & mask:
            comm.Send([work, dt], dest=(vr - mask + root) % p, tag=TAG_REDUCE)
            break
        if vr + mask < p:
            comm.Recv([incoming, dt], source=(vr + mask + root) % p, tag=TAG_REDUCE)
            ufunc(work, incoming, out=work)
        mask <<= 1
    if r != root:
        return None
    if recvbuf is None:
        recvbuf = np.empty(np.shape(sendbuf), dtype=src.dtype)
    out = _flat(recvbuf)
    if out.size != work.size:
        raise LoomError(
            f"reduce: recvbuf has {out.size} elements, sendbuf {work.size}", hint="give both the same size"
        )
    out[...] = work
    return recvbuf


def scatter(comm: Any, sendbuf: Any, recvbuf: Any, root: int = 0) -> Any:
    """Binomial-tree scatter from `root` (Thakur et al. 2005): rank i receives block i of `sendbuf`.

    `sendbuf` (significant on the root only) holds p equal blocks of `recvbuf.size` elements. Each
    tree node receives the blocks of its whole subtree from its parent, keeps the first and forwards
    the rest in halves: ceil(log2 p) rounds and (p-1)/p·n elements out of the root. Returns `recvbuf`.
    """
    _check_root(comm, root)
    out = _flat(recvbuf)
    p, r = comm.Get_size(), comm.Get_rank()
    count, dt, vr = out.size, mpi_dtype(out.dtype), (r - root) % p
    if r == root:
        src = _flat(sendbuf)
        if src.size != p * count or src.dtype != out.dtype:
            raise LoomError(
                f"scatter: root needs {p}×{count} {out.dtype} elements, got {src.size} {src.dtype}",
                hint="sendbuf holds one recvbuf-sized block per rank, of recvbuf's dtype",
            )
        # Rotate so that block v belongs to relative rank v: the root's own block comes first.
        tmp = np.concatenate([src[root * count :], src[: root * count]])
    if count == 0:
        return recvbuf
    mask = 1
    while mask < p and not vr & mask:
        mask <<= 1
    if vr != 0:  # receive my subtree's blocks: relative ranks vr .. vr + min(mask, p - vr) - 1
        tmp = np.empty(min(mask, p - vr) * count, dtype=out.dtype)
        comm.Recv([tmp, dt], source=(vr - mask + root) % p, tag=TAG_SCATTER)
    mask >>= 1
    while mask > 0:
        if vr + mask < p:
            n_blocks = min(mask, p - vr - mask)
            comm.Send(
                [tmp[mask * count : (mask + n_blocks) * count], dt],
                dest=(vr + mask + root) % p,
                tag=TAG_SCATTER,
            )
        mask >>= 1
    out[...] = tmp[:count]
    return recvbuf


def allgather(comm: Any, sendbuf: Any, recvbuf: Any = None) -> Any:
    """All-gather of equal blocks: `recvbuf[i]` = rank i's `sendbuf`, on every rank (ring, p-1 steps).

    `recvbuf` defaults to a new numpy array of shape (p, *sendbuf.shape). Equals MPI's `Allgather`.
    """
    src = _flat(sendbuf)
    p, r = comm.Get_size(), comm.Get_rank()
    if recvbuf is None:
        recvbuf = np.empty((p, *np.shape(sendbuf)), dtype=src.dtype)
    out = _flat(recvbuf)
    if out.size != p * src.size or out.dtype != src.dtype:
        raise LoomError(
            f"allgather: recvbuf needs {p}×{src.size} {src.dtype} elements, got {out.size} {out.dtype}",
            hint="leave recvbuf=None to get a new (p, *sendbuf.shape) array",
        )
    out[r * src.size : (r + 1) * src.size] = src
    _ring_allgather(comm, out)
    return recvbuf
