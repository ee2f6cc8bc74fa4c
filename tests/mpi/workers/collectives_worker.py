"""Every collective of loom.parallel.collectives against mpi4py's built-in one, on this world size.

Integer-valued data makes sums exact in every dtype, so those comparisons are bit-for-bit; random
normal data checks float sums to a tolerance (the order of additions differs between algorithms).
"""

from __future__ import annotations

import numpy as np
from _common import run

from loom.errors import LoomError
from loom.parallel import collectives as C

SIZES = (0, 1, 7, 1000, 100003)
DTYPES = (np.float32, np.float64, np.float16, np.int32, np.int64)
TOL = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}


def mpi_op(op: str):
    """The `MPI.Op` for a reduction name: "sum", "prod", "max" or "min"."""
    from mpi4py import MPI

    C._ufunc(op)
    return {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]


def ring_allgather(comm, buf):
    """Ring all-gather, in place (Patarasuk & Yuan 2009, second half of the ring all-reduce).

    `buf` has the full size n on every rank; chunk `rank` (sizes from `chunk_sizes(n, world_size)`)
    is this rank's contribution. Afterwards every chunk holds its owner's data, on every rank. Equals
    MPI's `Allgatherv` with those counts. Returns `buf`.
    """
    C._ring_allgather(comm, C._flat(buf))
    return buf


def data(comm, n, dtype, kind="int", salt=0):
    rng = np.random.default_rng([comm.Get_rank(), n, np.dtype(dtype).num, salt])
    if kind == "int":
        return rng.integers(-4, 5, size=n).astype(dtype)
    if kind == "prod":  # |product| over <= 4 ranks stays <= 16: exact everywhere
        return rng.choice(np.array([-2, -1, 1, 2]), size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def same(a, b, dtype, kind, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if kind == "float":
        tol = TOL[dtype]
        assert np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol), what
    else:
        assert np.array_equal(a, b), (what, a[:8], b[:8])


def check_allreduce(comm, MPI, n, dtype):
    cases = [("sum", "int"), ("sum", "float")] if np.dtype(dtype).kind == "f" else [("sum", "int")]
    if n <= 1000:
        cases += [("max", "int"), ("min", "int"), ("prod", "prod")]
    for op, kind in cases:
        x = data(comm, n, dtype, kind)
        want = np.empty_like(x)
        comm.Allreduce([x, C.mpi_dtype(dtype)], [want, C.mpi_dtype(dtype)], op=mpi_op(op))
        got = x.copy()
        assert C.ring_allreduce(comm, got, op=op) is got
        same(got, want, dtype, kind, f"ring_allreduce {op} n={n} {dtype}")


def check_reduce_scatter_allgather(comm, MPI, n, dtype):
    p, r = comm.Get_size(), comm.Get_rank()
    counts = C.chunk_sizes(n, p)
    assert sum(counts) == n and max(counts) - min(counts) <= 1
    off = sum(counts[:r])
    dt = C.mpi_dtype(dtype)
    for kind in ("int", "float") if np.dtype(dtype).kind == "f" else ("int",):
        x = data(comm, n, dtype, kind, salt=1)
        want = np.empty(counts[r], dtype=dtype)
        comm.Reduce_scatter([x, dt], [want, dt], recvcounts=counts, op=MPI.SUM)
        got = C.ring_reduce_scatter(comm, x.copy())
        same(got, want, dtype, kind, f"ring_reduce_scatter n={n} {dtype}")

    # Ring all-gather: chunk r of a full-size buffer is this rank's contribution.
    mine = data(comm, counts[r], dtype, salt=2)
    want = np.empty(n, dtype=dtype)
    comm.Allgatherv([mine, dt], [want, (counts, None), dt])
    buf = np.zeros(n, dtype=dtype)
    buf[off : off + counts[r]] = mine
    same(ring_allgather(comm, buf), want, dtype, "int", f"ring_allgather n={n} {dtype}")

    # Equal-block all-gather of n elements per rank.
    x = data(comm, n, dtype, salt=3).reshape(-1, 1) if n else data(comm, 0, dtype)
    want = np.empty((p, *x.shape), dtype=dtype)
    comm.Allgather([x, dt], [want, dt])
    same(C.allgather(comm, x), want, dtype, "int", f"allgather n={n} {dtype}")


def check_rooted(comm, MPI, n, dtype):
    p, r = comm.Get_size(), comm.Get_rank()
    dt = C.mpi_dtype(dtype)
    for root in sorted({0, p - 1, p // 2}):
        x = data(comm, n, dtype, salt=10 + root)
        want = x.copy()
        comm.Bcast([want, dt], root=root)
        got = x.copy()
        same(C.broadcast(comm, got, root=root), want, dtype, "int", f"broadcast n={n} root={root} {dtype}")

        for kind in ("int", "float") if np.dtype(dtype).kind == "f" else ("int",):
            x = data(comm, n, dtype, kind, salt=20 + root)
            want = np.empty_like(x)
            comm.Reduce([x, dt], [want, dt], op=MPI.SUM, root=root)
            before = x.copy()
            got = C.reduce(comm, x, op="sum", root=root)
            assert np.array_equal(x, before), "reduce modified sendbuf"
            if r == root:
                same(got, want, dtype, kind, f"reduce n={n} root={root} {dtype}")
            else:
                assert got is None

        send = data(comm, p * n, dtype, salt=30 + root)  # significant on the root only
        want = np.empty(n, dtype=dtype)
        comm.Scatter([send, dt], [want, dt], root=root)
        got = np.full(n, 99, dtype=dtype)
        same(C.scatter(comm, send, got, root=root), want, dtype, "int", f"scatter n={n} root={root} {dtype}")


def check_errors(comm):
    for bad, what in [
        (lambda: C.ring_allreduce(comm, np.zeros(3, np.uint8)), "uint8"),
        (lambda: C.ring_allreduce(comm, np.zeros((4, 4), np.float32)[:, 0]), "non-contiguous"),
        (lambda: C.ring_allreduce(comm, np.zeros(3, np.float32), op="mean"), "unknown op"),
        (lambda: C.ring_allreduce(comm, [1.0, 2.0]), "list"),
        (lambda: C.broadcast(comm, np.zeros(3), root=comm.Get_size()), "root out of range"),
    ]:
        try:
            bad()
        except LoomError as e:
            assert e.hint, what
        else:
            raise AssertionError(f"no LoomError for {what}")


def main(comm):
    from mpi4py import MPI

    check_errors(comm)
    for dtype in DTYPES:
        for n in SIZES:
            check_allreduce(comm, MPI, n, dtype)
            check_reduce_scatter_allgather(comm, MPI, n, dtype)
            check_rooted(comm, MPI, n, dtype)
    assert C.chunk_sizes(7, 3) == [3, 2, 2] and C.chunk_sizes(2, 4) == [1, 1, 0, 0]


if __name__ == "__main__":
    run(main)
