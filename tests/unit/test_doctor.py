"""`loom doctor` against nvidia-smi's own output and this CPU machine.

Compared against: `nvidia-smi topo -m` output in its exact layout (tab-separated header of device columns
then "CPU Affinity / NUMA Affinity / GPU NUMA ID", one row per GPU and NIC, then the Legend block), stored in
tests/fixtures/topo_*.txt; the expected matrices are read off those files by eye. The full report is
checked for its keys and for what is known about this machine (CPU-only torch, no nvidia-smi).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from loom import doctor
from loom.doctor import cuda_consistency, doctor_main, parse_topo, topo_verdict
from loom.errors import LoomError

FIXTURES = Path(__file__).parent.parent / "fixtures"


def test_two_gpus_over_nvlink():
    gpus, matrix, verdict = parse_topo((FIXTURES / "topo_nv2.txt").read_text())
    assert gpus == ["GPU0", "GPU1"]
    assert matrix == [["X", "NV2"], ["NV2", "X"]]
    assert verdict == "NVLink between all pairs (NV2)"


def test_two_gpus_over_pcie_host_bridge():
    gpus, matrix, verdict = parse_topo((FIXTURES / "topo_phb.txt").read_text())
    assert gpus == ["GPU0", "GPU1"]
    assert matrix == [["X", "PHB"], ["PHB", "X"]]
    assert verdict.startswith("PCIe only") and "PHB" in verdict


def test_four_gpus_mixed_with_a_nic_column():
    gpus, matrix, verdict = parse_topo((FIXTURES / "topo_mixed4.txt").read_text())
    assert gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]  # NIC0 column and row left out
    assert matrix == [
        ["X", "NV4", "SYS", "SYS"],
        ["NV4", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "NV4"],
        ["SYS", "SYS", "NV4", "X"],
    ]
    assert verdict.startswith("mixed") and "2 of 6" in verdict and "SYS" in verdict


def test_terminal_underline_escapes_and_space_alignment():
    """On a terminal nvidia-smi underlines the header; pasted output is often space-aligned."""
    text = (FIXTURES / "topo_nv2.txt").read_text()
    underlined = text.replace("\tGPU0", "\x1b[4m\tGPU0", 1).replace("GPU NUMA ID", "GPU NUMA ID\x1b[0m", 1)
    spaced = text.replace("\t", "    ")
    for t in (underlined, spaced):
        assert parse_topo(t)[:2] == (["GPU0", "GPU1"], [["X", "NV2"], ["NV2", "X"]])


def test_one_gpu_and_no_output():
    one = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-19\t0\t\tN/A\n\nLegend:\n"
    assert parse_topo(one) == (["GPU0"], [["X"]], "one GPU: no GPU-to-GPU link to use")
    assert parse_topo("") == ([], [], "no GPUs")
    assert parse_topo("No devices were found\n")[2] == "no GPUs"


def test_verdict_names_every_nvlink_width():
    m = [["X", "NV12", "NV4"], ["NV12", "X", "NV12"], ["NV4", "NV12", "X"]]
    assert topo_verdict(["GPU0", "GPU1", "GPU2"], m) == "NVLink between all pairs (NV4, NV12)"


@pytest.mark.parametrize(
    "torch_cuda, driver, ok",
    [
        (None, "12.4", None),
        ("12.1", None, None),
        ("12.1", "12.4", True),
        ("12.4", "12.2", True),
        ("12.4", "11.8", False),
    ],
)
def test_cuda_consistency(torch_cuda, driver, ok):
    assert cuda_consistency(torch_cuda, driver)[0] is ok


def test_compile_check_timeout_is_reported_not_raised():
    r = doctor.compile_check(timeout=0.01)
    assert r["checked"] and r["ok"] is False and "timed out" in r["error"]


def test_json_report_on_this_machine(capsys):
    assert doctor_main(["--json", "--no-compile-check"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r) >= {
        "loom",
        "python",
        "platform",
        "torch",
        "cuda",
        "devices",
        "cpu",
        "topology",
        "env",
        "mpi",
        "triton",
        "fp8",
        "compile",
        "launchers",
        "problems",
    }
    assert set(r["torch"]) >= {"version", "cuda", "cudnn", "nccl", "backends", "cuda_available"}
    assert set(r["cuda"]) >= {"driver_version", "driver_cuda", "consistent", "note"}
    assert set(r["topology"]) == {"gpus", "matrix", "verdict"}
    assert set(r["launchers"]) >= {"torchrun", "mpiexec", "srun", "qsub"}
    assert r["compile"] == {"checked": False}
    assert isinstance(r["problems"], list)
    import torch

    if not torch.cuda.is_available():
        assert r["devices"] == [] and r["torch"]["backends"]["gloo"] is True
        if r["fp8"]["available"]:  # torchao installed: float8 matmuls emulated on this CPU
            assert r["fp8"]["matmuls"].startswith("CPU emulation")
    if importlib.util.find_spec("torchao") is None:
        assert "loom[fp8]" in r["fp8"]["error"]
    if r["mpi"]["mpi4py"] and "error" not in r["mpi"]:
        assert r["mpi"]["vendor"] and isinstance(r["mpi"]["cuda_aware"], bool)


def test_human_report(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert doctor_main(["--no-compile-check", "--no-mpi-check"]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "interconnect", "launchers", "not checked", "NCCL_P2P_DISABLE=1", "peer-to-peer"):
        assert word in out


@pytest.mark.parametrize(
    "option,value,message",
    [
        ("--port", "0", "--port 0 is not a TCP port"),
        ("--port", "-5", "--port -5 is not a TCP port"),
        ("--nproc-per-node", "0", "--nproc-per-node must be >= 1, got 0"),
    ],
)
def test_nodes_check_refuses_nonsense_counts(tmp_path, option, value, message):
    """--port 0 was read as 'not given', a negative port was used as it was, 0 processes per node compared."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost\n")
    with pytest.raises(LoomError, match=message):
        doctor_main(["--nodes", str(hosts), option, value])
