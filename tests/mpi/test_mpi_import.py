"""Import hygiene of the MPI modules, compared with the house rule: no mpi4py at import time.

Runs in a fresh interpreter (never in the pytest process, which must not initialise MPI).
"""

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

CHECK = """
import sys
import loom.parallel.collectives, loom.parallel.mpi_dp
assert "mpi4py" not in sys.modules, "mpi4py imported at module level"
sys.modules["mpi4py"] = None  # as if it were not installed
from loom.errors import LoomError
from loom.parallel.mpi_dp import cuda_aware_mpi, mpi_comm
try:
    mpi_comm()
except LoomError as e:
    assert "loom[mpi]" in e.hint, e.hint
else:
    raise AssertionError("mpi_comm() without mpi4py did not raise")
assert cuda_aware_mpi() is False
print("OK")
"""


def test_no_mpi4py_at_import_and_clear_error_without_it():
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
