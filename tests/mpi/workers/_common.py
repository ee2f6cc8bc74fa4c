"""Shared by the MPI worker scripts: run a check on COMM_WORLD and abort every rank on failure."""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from collections.abc import Callable


def run(main: Callable) -> None:
    """Call main(comm); on any exception print it with the rank and MPI-abort, so no rank hangs."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        main(comm)
    except BaseException:
        print(f"[rank {comm.Get_rank()}/{comm.Get_size()}] FAILED", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(f"OK {comm.Get_size()} ranks", flush=True)


class CountingComm:
    """Wraps a communicator and counts the communicating calls made through it."""

    COUNTED = ("Allreduce", "Iallreduce", "Sendrecv", "Send", "Recv", "Bcast")

    def __init__(self, comm):
        self._comm = comm
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in self.COUNTED:
            return attr

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return counted

    def total(self) -> int:
        return sum(self.calls.values())
