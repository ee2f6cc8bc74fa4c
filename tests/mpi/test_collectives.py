"""loom's own collectives (ring all-reduce, reduce-scatter, all-gather, binomial broadcast / reduce /
scatter) compared with mpi4py's built-in MPI collectives under `mpiexec -n N`.

Sizes 0, 1, 7, 1000 and 100003 (uneven chunks, empty chunks), dtypes float16/32/64 and int32/64,
several roots; the checks themselves are in workers/collectives_worker.py.
"""

import pytest


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_equal_mpi_builtins(mpirun, n):
    out = mpirun("collectives_worker.py", n)
    assert f"OK {n} ranks" in out
