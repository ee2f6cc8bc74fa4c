"""`loom doctor`: what this machine can run, and what would slow it down or stop it (layer 5).

Versions (Python, torch, CUDA, cuDNN, NCCL) and whether torch's CUDA fits the driver; devices with memory,
compute capability, bf16 / tf32; the GPU interconnect from `nvidia-smi topo -m` with a one-line verdict;
the environment variables that change how NCCL uses it; the MPI library and whether it is CUDA-aware;
Triton and torch.compile; the launchers on PATH. Probes that can hang or initialise a runtime (MPI,
torch.compile) run in a child process with a timeout, so the doctor itself always answers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from loom import __version__, log
from loom.errors import LoomError

LAUNCHERS = ("torchrun", "mpiexec", "mpirun", "srun", "sbatch", "qsub")
# Variables that change which paths NCCL / CUDA use between GPUs, and what they do when set.
ENV_EFFECTS = {
    "CUDA_VISIBLE_DEVICES": "which GPUs this process sees, and in what order",
    "CUDA_DEVICE_ORDER": "GPU numbering (PCI_BUS_ID matches nvidia-smi)",
    "NVIDIA_VISIBLE_DEVICES": "GPUs a container exposes",
    "NCCL_P2P_DISABLE": "1: no NVLink/PCIe peer-to-peer; GPU traffic is staged through host memory",
    "NCCL_P2P_LEVEL": "the farthest path (NVL, PIX, PXB, PHB, SYS) NCCL still uses peer-to-peer on",
    "NCCL_SHM_DISABLE": "1: no shared-memory transport between processes on a node",
    "NCCL_IB_DISABLE": "1: no InfiniBand/RoCE; inter-node traffic goes over TCP sockets",
    "NCCL_NET_GDR_LEVEL": "the farthest path on which the NIC reads GPU memory directly (GPUDirect RDMA)",
    "NCCL_SOCKET_IFNAME": "network interfaces NCCL's sockets use",
    "NCCL_NVLS_ENABLE": "NVLink SHARP (in-switch reductions) on NVSwitch systems",
    "NCCL_ALGO": "forces the collective algorithm (Ring, Tree, ...)",
    "NCCL_PROTO": "forces the protocol (LL, LL128, Simple)",
    "NCCL_DEBUG": "NCCL logging (INFO prints the chosen transports)",
    "OMP_NUM_THREADS": "CPU threads per process",
}
_NV = re.compile(r"^NV\d+$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# PCIe paths from nearest to farthest (nvidia-smi's legend; SOC is the old name of SYS).
_PCIE_ORDER = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")


# ------------------------------------------------------------------------------------------- topology


def parse_topo(text: str) -> tuple[list[str], list[list[str]], str]:
    """`nvidia-smi topo -m` -> (GPU names, GPU x GPU matrix of link types, one-line verdict).

    The header row lists the device columns (GPUs, then NICs) before `CPU Affinity`; each `GPUn` row
    gives the link to every column ("X" for itself). NIC rows and the legend are ignored.
    """
    cols: list[str] = []
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        tokens = _ANSI.sub("", line).split()
        if not tokens:
            continue
        if tokens[0].startswith("Legend"):
            break
        if not cols:  # the header: device columns, then "CPU Affinity", "NUMA Affinity", ...
            if "Affinity" in tokens and re.fullmatch(r"GPU\d+", tokens[0]):
                cols = tokens[: tokens.index("CPU")] if "CPU" in tokens else []
        elif re.fullmatch(r"GPU\d+", tokens[0]) and len(tokens) > len(cols):
            rows[tokens[0]] = tokens[1 : 1 + len(cols)]
    gpus = [c for c in cols if re.fullmatch(r"GPU\d+", c) and c in rows]
    matrix = [[rows[g][cols.index(h)] for h in gpus] for g in gpus]
    return gpus, matrix, topo_verdict(gpus, matrix)


def topo_verdict(gpus: list[str], matrix: list[list[str]]) -> str:
    """NVLink between all pairs / PCIe only / mixed, from a link matrix."""
    if not gpus:
        return "no GPUs"
    if len(gpus) == 1:
        return "one GPU: no GPU-to-GPU link to use"
    pairs = [matrix[i][j] for i in range(len(gpus)) for j in range(i + 1, len(gpus))]
    nv = [p for p in pairs if _NV.match(p)]
    pcie = [p for p in pairs if not _NV.match(p)]
    worst = (
        max(pcie, key=lambda p: _PCIE_ORDER.index(p) if p in _PCIE_ORDER else len(_PCIE_ORDER))
        if pcie
        else None
    )
    if len(nv) == len(pairs):
        kinds = sorted(set(nv), key=lambda p: int(p[2:]))
        return f"NVLink between all pairs ({', '.join(kinds)})"
    if not nv:
        return f"PCIe only, no NVLink (farthest path: {worst})"
    return f"mixed: NVLink on {len(nv)} of {len(pairs)} GPU pairs, the others over PCIe (farthest: {worst})"


# ------------------------------------------------------------------------------------------- probes


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    """stdout of a command, or None if it is missing, fails or times out."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _version_tuple(v: str | None) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)", v or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def cuda_consistency(torch_cuda: str | None, driver_cuda: str | None) -> tuple[bool | None, str]:
    """Can torch's CUDA runtime run on this driver? (ok, note); ok is None when it cannot be told."""
    if torch_cuda is None:
        return None, "torch is a CPU-only build"
    t, d = _version_tuple(torch_cuda), _version_tuple(driver_cuda)
    if d is None or t is None:
        return (
            None,
            f"torch built for CUDA {torch_cuda}; the driver's CUDA version is unknown (no nvidia-smi)",
        )
    if t[0] > d[0]:
        return (
            False,
            f"torch needs CUDA {torch_cuda} but the driver supports up to {driver_cuda}: update the driver",
        )
    if t > d:
        return True, (
            f"torch's CUDA {torch_cuda} is newer than the driver's {driver_cuda}: works through minor-version "
            "compatibility, but PTX JIT may fail; a newer driver is safer"
        )
    return True, f"torch's CUDA {torch_cuda} runs on the driver's CUDA {driver_cuda}"


def driver_info() -> dict:
    """Driver and the CUDA version it supports, from nvidia-smi (None when absent)."""
    out = _run(["nvidia-smi"])
    ver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    m = re.search(r"CUDA(?: UMD)? Version:\s*([\d.]+)", out or "")
    return {
        "nvidia_smi": shutil.which("nvidia-smi"),
        "driver_version": ver.splitlines()[0].strip() if ver else None,
        "driver_cuda": m.group(1) if m else None,
    }


def _cpu() -> dict:
    import torch

    model, flags = None, set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return {
        "model": model or platform.processor() or None,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "capability": getattr(torch.backends, "cpu", None) and torch.backends.cpu.get_cpu_capability(),
        "bf16": "native (" + ", ".join(native) + ")" if native else "emulated (slow)" if flags else "unknown",
    }


def _devices() -> list[dict]:
    import torch

    from loom.metrics import FP8_MIN_CAPABILITY

    out = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cc = (p.major, p.minor)
            out.append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                    "multiprocessors": p.multi_processor_count,
                    "bf16": cc >= (8, 0),
                    "tf32": cc >= (8, 0),
                    "fp8": cc >= FP8_MIN_CAPABILITY,  # float8 tensor cores (precision.fp8)
                }
            )
    return out


def _torch_versions() -> dict:
    import torch
    import torch.distributed as dist

    nccl = None
    if torch.version.cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (AttributeError, RuntimeError):
            pass
    has_dist = dist.is_available()
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "cuda_available": torch.cuda.is_available(),
        "mps_available": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
        "backends": {
            name: has_dist and getattr(dist, f"is_{name}_available")() for name in ("nccl", "gloo", "mpi")
        },
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_matmul_enabled": torch.backends.cuda.matmul.allow_tf32,
    }


_MPI_PROBE = textwrap.dedent("""
    import json
    from mpi4py import MPI
    from loom.parallel.mpi_dp import cuda_aware_mpi
    name, version = MPI.get_vendor()
    print(json.dumps({"vendor": name, "vendor_version": ".".join(map(str, version)),
                      "library_version": MPI.Get_library_version().strip().splitlines()[0],
                      "mpi_standard": "%d.%d" % MPI.Get_version(), "cuda_aware": cuda_aware_mpi()}))
""")


def _start(code: str) -> subprocess.Popen:
    """Run a Python snippet in a child now; its answer is collected later, so probes overlap."""
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(child: subprocess.Popen, timeout: float) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a child; exit code None when it was killed for the timeout."""
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return None, "", ""
    return child.returncode, out, err


def _last_line(text: str, default: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else default


def mpi_info(timeout: float = 60, child: subprocess.Popen | None = None) -> dict:
    """mpi4py's MPI library and CUDA-awareness, probed in a child (importing mpi4py.MPI initialises MPI)."""
    if importlib.util.find_spec("mpi4py") is None:
        return {"mpi4py": None, "note": "mpi4py not installed (pip install 'loom[mpi]')"}
    import mpi4py

    info: dict = {"mpi4py": mpi4py.__version__}
    rc, out, err = _finish(child or _start(_MPI_PROBE), timeout)
    if rc is None:
        return info | {"error": f"MPI initialisation did not finish in {timeout:g} s"}
    if rc != 0:
        return info | {"error": _last_line(err, f"exit code {rc}")}
    return info | json.loads(_last_line(out, "{}"))


def triton_info() -> dict:
    """Whether Triton imports, and where its kernels can run."""
    import torch

    try:
        import triton
    except Exception as e:  # ImportError, or a broken install raising anything at import
        return {"available": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    where = "GPU" if torch.cuda.is_available() else "interpreter only (TRITON_INTERPRET=1; no GPU driver)"
    return {"available": True, "version": triton.__version__, "kernels": where}


def fp8_info() -> dict:
    """Whether precision.fp8 can run: torchao (the loom[fp8] extra) and where its float8 matmuls run."""
    import torch

    from loom.metrics import FP8_MIN_CAPABILITY

    spec = importlib.util.find_spec("torchao")
    if spec is None:
        return {"available": False, "error": "torchao not installed (pip install 'loom[fp8]')"}
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("torchao")
    except PackageNotFoundError:
        v = "unknown"
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    if caps:
        fast = [i for i, c in enumerate(caps) if c >= FP8_MIN_CAPABILITY]
        where = (
            f"float8 tensor cores on GPU {fast}"
            if fast
            else "no GPU here has float8 tensor cores (cc >= 8.9)"
        )
    else:
        where = "CPU emulation (for tests; no speed-up)"
    return {"available": True, "version": v, "matmuls": where}


_COMPILE_PROBE = """
import time, torch
t = time.perf_counter()
f = torch.compile(lambda x: torch.sin(x) * 2 + x)
x = torch.randn(64)
assert torch.allclose(f(x), torch.sin(x) * 2 + x, atol=1e-6)
print(f"{time.perf_counter() - t:.2f}")
"""


def compile_check(timeout: float = 120, child: subprocess.Popen | None = None) -> dict:
    """Compile a tiny function with torch.compile on CPU in a child process (10-20 s the first time)."""
    rc, out, err = _finish(child or _start(_COMPILE_PROBE), timeout)
    if rc is None:
        return {"checked": True, "ok": False, "error": f"timed out after {timeout:g} s"}
    if rc != 0:
        return {"checked": True, "ok": False, "error": _last_line(err, f"exit code {rc}")}
    return {"checked": True, "ok": True, "seconds": float(_last_line(out, "nan"))}


def launchers() -> dict[str, str | None]:
    """Launchers found on PATH (or beside this Python, e.g. a virtual environment's torchrun)."""
    here = Path(sys.executable).parent
    return {n: shutil.which(n) or (str(here / n) if (here / n).is_file() else None) for n in LAUNCHERS}


def _problems(r: dict) -> list[str]:
    out = []
    if r["cuda"]["consistent"] is False:
        out.append(r["cuda"]["note"])
    if r["cuda"]["driver_version"] and not r["torch"]["cuda"]:
        out.append("NVIDIA GPUs are present but torch is a CPU-only build: install a CUDA build of torch")
    if r["torch"]["cuda"] and r["cuda"]["driver_version"] and not r["torch"]["cuda_available"]:
        out.append("torch has CUDA but sees no device: check CUDA_VISIBLE_DEVICES and the driver")
    if os.environ.get("NCCL_P2P_DISABLE") == "1" and "NVLink" in r["topology"]["verdict"]:
        out.append("NCCL_P2P_DISABLE=1 on a machine with NVLink: NCCL will not use it")
    if r["compile"].get("checked") and not r["compile"]["ok"]:
        out.append(f"torch.compile failed: {r['compile']['error']} (train without train.compile)")
    if r["mpi"].get("error"):
        out.append(f"MPI probe failed: {r['mpi']['error']}")
    return out


def collect(check_compile: bool = True, compile_timeout: float = 120, check_mpi: bool = True) -> dict:
    """The whole report as a JSON-ready dict."""
    import numpy

    # The slow probes run in children, started first so they overlap with each other and with the rest.
    mpi_child = _start(_MPI_PROBE) if check_mpi and importlib.util.find_spec("mpi4py") else None
    compile_child = _start(_COMPILE_PROBE) if check_compile else None
    tv = _torch_versions()
    drv = driver_info()
    ok, note = cuda_consistency(tv["cuda"], drv["driver_cuda"])
    topo_text = _run(["nvidia-smi", "topo", "-m"])
    gpus, matrix, verdict = parse_topo(topo_text) if topo_text else ([], [], "unknown (no nvidia-smi)")
    report = {
        "loom": __version__,
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "torch": tv,
        "cuda": drv | {"consistent": ok, "note": note},
        "devices": _devices(),
        "cpu": _cpu(),
        "topology": {"gpus": gpus, "matrix": matrix, "verdict": verdict},
        "env": {k: os.environ[k] for k in sorted(os.environ) if k in ENV_EFFECTS or k.startswith("NCCL_")},
        "mpi": mpi_info(child=mpi_child) if check_mpi else {"checked": False},
        "triton": triton_info(),
        "fp8": fp8_info(),
        "compile": compile_check(compile_timeout, compile_child) if check_compile else {"checked": False},
        "launchers": launchers(),
    }
    report["problems"] = _problems(report)
    return report


# ------------------------------------------------------------------------------------------- output


def _yes(v) -> str:
    return "n/a" if v is None else ("yes" if v else "no")


def render(r: dict) -> None:
    """The report for people (rich)."""
    from rich.table import Table

    con = log.console()
    kv = Table(box=None, show_header=False, pad_edge=False)
    kv.add_column(style="bold")
    kv.add_column()
    for k, v in _system_rows(r) + _tool_rows(r):
        kv.add_row(k, str(v))
    log.print_table(kv, con)
    _print_devices(con, r)
    _print_links(con, r["topology"])
    if r["env"]:
        con.print("environment:", style="bold")
        for k, v in r["env"].items():
            con.print(f"  {k}={v}  ({ENV_EFFECTS.get(k, 'NCCL setting')})", markup=False)
    for p in r["problems"]:
        con.print(f"problem: {p}", style="red", markup=False)
    if not r["problems"]:
        con.print("no problems found", style="green")


def _system_rows(r: dict) -> list[tuple[str, str]]:
    """(name, value) of loom, python, torch, the driver, the CPU, precision and the interconnect."""
    t, c = r["torch"], r["cuda"]
    return [
        ("loom", r["loom"]),
        ("python", f"{r['python']['version']} ({r['python']['executable']})"),
        ("platform", r["platform"]),
        (
            "torch",
            f"{t['version']} | CUDA {t['cuda'] or '-'} | cuDNN {t['cudnn'] or '-'} | NCCL {t['nccl'] or '-'}",
        ),
        (
            "driver",
            f"{c['driver_version'] or '-'} (CUDA {c['driver_cuda'] or '-'})"
            if c["nvidia_smi"]
            else "no nvidia-smi",
        ),
        ("cuda check", c["note"]),
        ("backends", ", ".join(f"{k} {_yes(v)}" for k, v in t["backends"].items())),
        (
            "cpu",
            f"{r['cpu']['model']} | {r['cpu']['cores']} cores, torch threads {r['cpu']['torch_threads']} | "
            f"{r['cpu']['capability']} | bf16 {r['cpu']['bf16']}",
        ),
        (
            "precision",
            f"float32 matmul '{t['float32_matmul_precision']}', tf32 {_yes(t['tf32_matmul_enabled'])}",
        ),
        ("interconnect", r["topology"]["verdict"]),
    ]


def _tool_rows(r: dict) -> list[tuple[str, str]]:
    """(name, value) of MPI, triton, fp8, torch.compile and the launchers."""
    m = r["mpi"]
    mpi = (
        "not checked (--no-mpi-check)"
        if m.get("checked") is False
        else m.get("note")
        or m.get("error")
        or (
            f"{m['vendor']} {m['vendor_version']} (MPI {m['mpi_standard']}), mpi4py {m['mpi4py']}, "
            f"CUDA-aware {_yes(m['cuda_aware'])}"
        )
    )
    tr = r["triton"]
    f8 = r["fp8"]
    cp = r["compile"]
    return [
        ("mpi", mpi),
        (
            "triton",
            f"{tr['version']}, kernels: {tr['kernels']}" if tr["available"] else f"no ({tr['error']})",
        ),
        ("fp8", f"torchao {f8['version']}, {f8['matmuls']}" if f8["available"] else f"no ({f8['error']})"),
        (
            "torch.compile",
            "not checked (--no-compile-check)"
            if not cp["checked"]
            else f"works ({cp['seconds']:.1f} s for a tiny function)"
            if cp["ok"]
            else f"FAILS: {cp['error']}",
        ),
        ("launchers", ", ".join(n for n, p in r["launchers"].items() if p) or "none"),
    ]


def _print_devices(con, r: dict) -> None:
    from rich.table import Table

    if r["devices"]:
        dev = Table(title="devices", title_justify="left")
        for col in ("#", "name", "memory", "capability", "SMs", "bf16", "tf32", "fp8"):
            dev.add_column(col)
        for d in r["devices"]:
            dev.add_row(
                str(d["index"]),
                d["name"],
                f"{d['memory_gib']} GiB",
                d["capability"],
                str(d["multiprocessors"]),
                _yes(d["bf16"]),
                _yes(d["tf32"]),
                _yes(d["fp8"]),
            )
        log.print_table(dev, con)
    else:
        con.print(
            "devices: no CUDA device"
            + (" (MPS available)" if r["torch"]["mps_available"] else "")
            + "; CPU only"
        )


def _print_links(con, topology: dict) -> None:
    """nvidia-smi's matrix of links between the GPUs, when there are several."""
    from rich.table import Table

    gpus, matrix = topology["gpus"], topology["matrix"]
    if len(gpus) > 1:
        topo = Table(title="GPU links (nvidia-smi topo -m)", title_justify="left")
        topo.add_column("")
        for g in gpus:
            topo.add_column(g)
        for g, row in zip(gpus, matrix, strict=True):
            topo.add_row(g, *row)
        log.print_table(topo, con)


# ------------------------------------------------------------------------- several nodes (--nodes)


def this_node(hosts: list[str], node_rank: int | None, environ) -> int:
    """Which host of the hostfile this is: --node-rank, the scheduler's node index, or the hostname."""
    import socket

    from loom.launch.detect import node_task

    if node_rank is None:
        task = node_task(environ)
        node_rank = task[0] if task else None
    if node_rank is None:
        names = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
        matches = [i for i, h in enumerate(hosts) if h in names or h.split(".")[0] in names]
        if len(matches) != 1:
            raise LoomError(
                f"cannot tell which host of the hostfile this is ({socket.gethostname()} is "
                f"{'not in it' if not matches else 'in it more than once'})",
                hint="pass --node-rank I (0 for the first host), or run it under srun / pbsdsh",
            )
        node_rank = matches[0]
    if not 0 <= node_rank < len(hosts):
        raise LoomError(
            f"--node-rank {node_rank} is outside the {len(hosts)} hosts of the hostfile",
            hint=f"use 0 .. {len(hosts) - 1}",
        )
    return node_rank


def nodes_check(
    hostfile: str,
    node_rank: int | None = None,
    master_addr: str | None = None,
    port: int | None = None,
    timeout: float = 60,
    nproc: int | None = None,
    megabytes: float = 4,
    environ=None,
) -> dict:
    """`loom doctor --nodes HOSTFILE`, run on every host: the launch gate, then an all-reduce between hosts.

    The gate (`loom.launch.gate`) shows a wrong MASTER_ADDR, a host that is down or cannot reach the head,
    a port in use, and different loom / torch / Python versions or processes per node, each as a LoomError
    that says what to do. Then one process per host all-reduces `megabytes` of float32 over gloo at the
    rendezvous address, and node 0 reports the bus bandwidth (2 (n-1)/n bytes per byte reduced, as
    nccl-tests count it).
    """
    import datetime
    import time

    from loom.env import port_from_job_id, read_hostfile
    from loom.launch.detect import default_nproc_per_node
    from loom.launch.gate import head_gate, local_hello, node_gate

    environ = os.environ if environ is None else environ
    hosts = read_hostfile(hostfile, "--nodes")
    node = this_node(hosts, node_rank, environ)
    addr = master_addr or environ.get("MASTER_ADDR", "").strip() or hosts[0]
    job = environ.get("SLURM_JOB_ID") or environ.get("PBS_JOBID")
    port = port or (
        int(environ["MASTER_PORT"]) if environ.get("MASTER_PORT", "").isdigit() else port_from_job_id(job)
    )
    hello = local_hello(node, nproc or default_nproc_per_node(environ), environ)
    report = {"hosts": hosts, "node": node, "rendezvous": f"{addr}:{port}"}
    if len(hosts) == 1:
        return {**report, "hellos": [hello.__dict__]}
    if node == 0:
        report["hellos"] = [
            h.__dict__
            for h in head_gate(addr, port, len(hosts), hello, timeout, hosts, "loom doctor --nodes")
        ]
    else:
        node_gate(addr, port, hello, timeout, hosts, command="loom doctor --nodes")

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=node,
        world_size=len(hosts),
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        x = torch.ones(max(1, int(megabytes * 2**20 / 4)))
        dist.all_reduce(x)  # the first one also connects the pairs
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    n, seconds = len(hosts), sorted(times)[len(times) // 2]
    report["allreduce"] = {
        "megabytes": x.numel() * 4 / 2**20,
        "median_ms": seconds * 1e3,
        "bus_gb_s": x.numel() * 4 * 2 * (n - 1) / n / seconds / 1e9,
    }
    return report


def render_nodes(r: dict) -> None:
    if "hellos" not in r:
        log.info(f"node {r['node']}: checked in with {r['rendezvous']}; node 0 prints the report")
    else:
        log.info(
            f"{len(r['hosts'])} host(s) checked in at {r['rendezvous']}: loom, torch, Python and processes "
            "per node agree"
        )
        for h in r["hellos"]:
            log.info(
                f"  node {h['node']} {h['host']}: loom {h['loom']}, torch {h['torch']}, Python {h['python']}, "
                f"{h['nproc']} proc"
            )
    if "allreduce" in r and "hellos" in r:
        a = r["allreduce"]
        log.info(
            f"all-reduce of {a['megabytes']:.1f} MiB between the hosts (gloo, one process each): "
            f"{a['median_ms']:.1f} ms, bus bandwidth {a['bus_gb_s']:.2f} GB/s"
        )


def doctor_main(argv: list[str]) -> int:
    """`loom doctor [--json] [--no-compile-check] [--no-mpi-check]`, or `loom doctor --nodes HOSTFILE ...`."""
    p = argparse.ArgumentParser(
        prog="loom doctor", description="Report what this machine can run and how fast."
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--nodes",
        metavar="HOSTFILE",
        default=None,
        help="before a multi-node job, run on every host: checks that each reaches the rendezvous address and "
        "port and that versions agree, and reports the all-reduce bandwidth between hosts",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="with --nodes: this host's index in HOSTFILE "
        "(default: the scheduler's node index, or the hostname's line)",
    )
    p.add_argument(
        "--master-addr",
        default=None,
        help="with --nodes: rendezvous address (default: $MASTER_ADDR, or the first host)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="with --nodes: rendezvous port (default: $MASTER_PORT, or from the job id)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="with --nodes: the processes per node "
        "the job will start, compared across hosts (default: visible GPUs, or 1)",
    )
    p.add_argument("--timeout", type=float, default=60, help="with --nodes: seconds to wait for every host")
    p.add_argument("--no-compile-check", action="store_true", help="skip the torch.compile test (10-20 s)")
    p.add_argument("--compile-timeout", type=float, default=120, help="seconds allowed for it (default 120)")
    p.add_argument("--no-mpi-check", action="store_true", help="skip the MPI probe (it initialises MPI)")
    args = p.parse_args(argv)
    if args.nodes:
        if not args.timeout > 0:
            raise LoomError(f"--timeout must be > 0 seconds, got {args.timeout}", hint="e.g. --timeout 60")
        if args.port is not None and not 0 < args.port < 65536:  # 0 was read as "not given"
            raise LoomError(
                f"--port {args.port} is not a TCP port", hint="pick a port in 1024-65535, e.g. 29500"
            )
        if args.nproc_per_node is not None and args.nproc_per_node < 1:
            raise LoomError(
                f"--nproc-per-node must be >= 1, got {args.nproc_per_node}",
                hint="leave it out for the visible GPUs (or 1)",
            )
        nodes = nodes_check(
            args.nodes, args.node_rank, args.master_addr, args.port, args.timeout, args.nproc_per_node
        )
        if args.json:
            sys.stdout.write(json.dumps(nodes, indent=1) + "\n")
        else:
            render_nodes(nodes)
        return 0
    if not args.compile_timeout > 0:
        raise LoomError(
            f"--compile-timeout must be > 0 seconds, got {args.compile_timeout}",
            hint="or --no-compile-check to skip the test",
        )
    if not args.no_compile_check and not args.json:  # the check takes 10-20 s: say so before it starts
        log.info("checking torch.compile (10-20 s; --no-compile-check skips it) ...")
    report = collect(not args.no_compile_check, args.compile_timeout, not args.no_mpi_check)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=1) + "\n")
    else:
        render(report)
    return 0
