"""`loom bench comm` end to end, compared against nccl-tests' definitions (doc/PERFORMANCE.md there):
busbw = algbw × 2(n-1)/n for all-reduce, × (n-1)/n for all-gather and reduce-scatter, × 1 for broadcast,
with bytes = the full buffer (gathered output, reduce-scatter input). Unit tests of the size parser and
of the bad-input errors; real 2-rank runs: mpi, ring and torch under mpiexec, torch and ring with --nproc.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from loom.bench.comm import comm_main, format_bytes, parse_size, parse_sizes
from loom.bench.comm_backends import bus_factor, element_count, record
from loom.errors import LoomError
from loom.launch.commands import find_mpiexec

FIELDS = {"backend", "op", "bytes", "world_size", "dtype", "time_us", "algbw_gbps", "busbw_gbps"}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# nccl-tests' factors written out for n = 2, 4, 8 (not computed by the code under test)
NCCL_TESTS = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0},
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "broadcast": 1.0},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "broadcast": 1.0},
}
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "PMI_RANK",
    "PMIX_RANK",
    "PALS_RANKID",
    "OMPI_COMM_WORLD_RANK",
    "SLURM_PROCID",
    "PBS_JOBID",
    "PBS_NODEFILE",
)


@pytest.fixture
def no_launcher(monkeypatch):
    """This process looks like a plain `loom bench comm`, whatever launched pytest."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------------------------------ units


def test_parse_size_units():
    assert parse_size("1KB") == 1024 and parse_size("1kb") == 1024 and parse_size("4K") == 4096
    assert parse_size("64MB") == 64 * 2**20 and parse_size("1GB") == 2**30 and parse_size("100") == 100
    assert parse_size(" 3 MB ") == 3 * 2**20 and parse_size("8B") == 8


def test_parse_sizes_ranges_and_lists():
    assert parse_sizes("1KB..16KB") == [1024, 2048, 4096, 8192, 16384]
    assert parse_sizes("1KB..1KB") == [1024]
    assert parse_sizes("3KB..13KB") == [3072, 6144, 12288]  # doubles while ≤ the end
    assert parse_sizes("64MB,1KB,1KB") == [1024, 64 * 2**20]  # sorted, unique
    assert parse_sizes("1KB..4KB,1MB") == [1024, 2048, 4096, 2**20]
    assert len(parse_sizes("1KB..256MB")) == 19


@pytest.mark.parametrize("text", ["", "1XB", "KB", "0KB", "-1KB", "1.5MB", "64MB..1KB", "1KB..", ","])
def test_parse_sizes_rejects(text):
    with pytest.raises(LoomError):
        parse_sizes(text)


@pytest.mark.parametrize("n", sorted(NCCL_TESTS))
def test_bus_factor_matches_nccl_tests(n):
    for op in OPS:
        assert bus_factor(op, n) == pytest.approx(NCCL_TESTS[n][op]), op
    assert bus_factor("all_reduce", 1) == 0 and bus_factor("broadcast", 1) == 1


def test_record_and_element_count():
    r = record("mpi", "all_gather", 2**20, 4, 1e-3, "float32")
    assert set(r) == FIELDS
    assert r["time_us"] == pytest.approx(1000) and r["algbw_gbps"] == pytest.approx(2**20 / 1e-3 / 1e9)
    assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 0.75)
    assert element_count("all_reduce", 1024, 4, 3) == 256
    assert element_count("all_gather", 1024, 4, 3) == 255  # n equal blocks, as nccl-tests rounds
    assert element_count("reduce_scatter", 4, 4, 3) == 3  # at least one element per rank
    assert [format_bytes(b) for b in (1024, 64 * 2**20, 2**30, 1020)] == ["1 KB", "64 MB", "1 GB", "1020 B"]


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--backend", "torch"], {}, "--nproc"),  # world size 1, no launcher
        ([], {}, "--nproc"),  # the default includes torch
        (["--backend", "tcp"], {}, "unknown backend"),
        (["--backend", "nccl"], {}, "--backend torch"),
        (["--ops", "allreduce"], {}, "unknown op"),
        (["--backend", "mpi", "--sizes", "1XB"], {}, "cannot parse size"),
        (["--backend", "mpi", "--dtype", "bf16"], {}, "bf16"),
        (["--backend", "mpi", "--iters", "0"], {}, "--iters"),
        (["--backend", "mpi"], {"RANK": "0", "WORLD_SIZE": "2"}, "mpiexec"),  # under torchrun
        (["--backend", "torch", "--nproc", "2"], {"RANK": "0", "WORLD_SIZE": "2"}, "drop --nproc"),
    ],
)
def test_bad_input_is_a_loom_error(no_launcher, monkeypatch, argv, env, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LoomError) as e:
        comm_main(argv)
    assert says in str(e.value)


@pytest.mark.parametrize("argv", [["--backend", "mpi"], ["--backend", "ring", "--nproc", "2"]])
def test_missing_mpi4py_names_the_extra(no_launcher, monkeypatch, argv):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails, find_spec says None
    with pytest.raises(LoomError) as e:
        comm_main([*argv, "--sizes", "1KB"])
    assert "loom[mpi]" in str(e.value)


# ------------------------------------------------------------------------------------ real runs

SMALL = ["--sizes", "1KB,64KB,1MB", "--iters", "3", "--warmup", "1"]


def _check(records, backends, world_size=2):
    assert sorted({r["backend"] for r in records}) == sorted(backends)
    assert len(records) == len(backends) * len(OPS) * 3
    for r in records:
        assert set(r) == FIELDS, r
        assert r["world_size"] == world_size and r["dtype"] == "float32" and r["time_us"] > 0
        assert r["bytes"] in (1024, 64 * 1024, 2**20)  # divisible by 2 ranks: nothing rounded
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * NCCL_TESTS[world_size][r["op"]])


def _mpiexec() -> str:
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install 'loom[mpi]')")
    found = find_mpiexec()
    if found is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH")
    return found


def test_under_mpiexec_all_backends(tmp_path):
    """The default backends under `mpiexec -n 2`: torch (gloo, port agreed through MPI), mpi and ring."""
    mpiexec = _mpiexec()
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [
        mpiexec,
        "-n",
        "2",
        sys.executable,
        "-m",
        "loom.bench.comm",
        *SMALL,
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check(json.loads(out.read_text()), ["torch", "mpi", "ring"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "busbw (GB/s)" in proc.stdout and proc.stdout.count("reduce_scatter") == 9  # one table, rank 0


def test_nproc_launches_one_job_per_backend(no_launcher, monkeypatch, tmp_path, capsys):
    """--nproc 2: torch through the elastic launcher, ring through mpiexec, merged in this process."""
    _mpiexec()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "r.json"
    assert comm_main(["--nproc", "2", "--backend", "torch,ring", *SMALL, "--json", str(out)]) == 0
    _check(json.loads(out.read_text()), ["torch", "ring"])
