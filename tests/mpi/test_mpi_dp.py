"""MPI data parallelism (loom.parallel.mpi_dp) compared with the single-process full-batch reference.

Under `mpiexec -n N` every rank computes the full-batch gradient itself and checks that NaiveSync,
BucketedSync (Iallreduce, one or many buckets) and BucketedSync (ring) produce it from per-rank
slices; that naive and bucketed agree to 1e-7 (bit-for-bit on 2 ranks); that no_sync accumulation
sends nothing before the last micro-step; and that SGD steps match single-process training.
The checks are in workers/dp_worker.py.
"""

import pytest


@pytest.mark.parametrize("n", [2, 3, 4])
def test_mpi_data_parallel_matches_single_process(mpirun, n):
    out = mpirun("dp_worker.py", n)
    assert f"OK {n} ranks" in out
