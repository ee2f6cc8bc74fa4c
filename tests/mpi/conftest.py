"""Runner for tests/mpi: starts a worker script under `mpiexec -n N` in a subprocess with a timeout.

mpiexec is looked up next to the running interpreter first (the `mpich` wheel installs it into the
virtualenv), then on PATH. Tests are skipped when mpi4py or mpiexec is missing. The pytest process
itself never imports mpi4py, so MPI is never initialised in it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom.launch.commands import find_mpiexec

WORKERS = Path(__file__).parent / "workers"
SRC = Path(__file__).resolve().parents[2] / "src"


find_mpiexec = functools.cache(find_mpiexec)


@functools.cache
def _is_open_mpi(mpiexec: str) -> bool:
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def run_mpi(worker: str, n: int, *args: str, timeout: float = 120) -> str:
    """Run tests/mpi/workers/<worker> on n ranks; fail with its output unless it exits 0. Returns stdout."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install 'loom[mpi]')")
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found next to the interpreter or on PATH")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    # One thread per rank: several ranks share few cores.
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [mpiexec, "-n", str(n)]
    if _is_open_mpi(mpiexec):  # as root, and with more ranks than cores
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        cmd.append("--oversubscribe")
    cmd += [sys.executable, str(WORKERS / worker), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout} s\n{e.stdout or ''}\n{e.stderr or ''}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@pytest.fixture
def mpirun():
    """The `run_mpi(worker, n, *args, timeout=120)` function."""
    return run_mpi
