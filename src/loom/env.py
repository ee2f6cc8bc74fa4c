"""Who am I in the job? `DistEnv` from the variables each launcher sets (layer 0, standard library only).

Every launcher tells a process its rank in its own dialect. `detect_env()` reads them in a fixed
priority, so that a process started by torchrun inside a Slurm step (which sees both dialects) takes
torchrun's view:

1. torchrun / torch elastic (also a hand-set env:// rendezvous): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
   `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`.
2. MPI: Open MPI (`OMPI_COMM_WORLD_*`), then MPICH Hydra / Intel MPI / Cray PMI (`PMI_RANK`, `PMI_SIZE`,
   `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`, `PMI_LOCAL_RANK`, `PMI_LOCAL_SIZE`), PMIx (`PMIX_RANK`) and
   Cray PALS as on Polaris / Aurora (`PALS_RANKID`, `PALS_LOCAL_RANKID`, `PALS_LOCAL_SIZE`).
3. Slurm, inside an `srun` step: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID`, ...
4. PBS: a job script run by PBS itself is one process; the nodefile gives the head host.
5. Nothing: one process, rank 0 of 1, on 127.0.0.1.

`MASTER_ADDR` / `MASTER_PORT`, when set, win for every source. Otherwise the address is the first host
of the Slurm node list or PBS nodefile, and the port is derived from the job id, so every rank of a
job computes the same value without talking and two jobs sharing a node rarely collide.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import os
import platform
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from loom.errors import LoomError

DEFAULT_MASTER_PORT = 29500  # torch.distributed's own default
_PORT_BASE, _PORT_SPAN = 20000, 20000  # job-derived ports fall in [20000, 40000): below the ephemeral range

SOURCES = ("torchrun", "openmpi", "mpich/pmi", "slurm", "pbs", "none")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as its launcher described it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    source: str  # one of SOURCES: the dialect of the variables read
    restarts: int = 0  # times torch elastic restarted the job's workers (restart_count), read with the rest
    # who started the process, as the log names it: torchrun's dialect is spoken by torchrun, by `loom train
    # --nproc` (loom.train.spawn) and by hand (RANK/WORLD_SIZE set); "" means the source says it
    launcher: str = field(default="", compare=False)

    @property
    def launched_by(self) -> str:
        return self.launcher or self.source

    def __str__(self) -> str:
        return (
            f"rank={self.rank}/{self.world_size} local={self.local_rank}/{self.local_world_size} "
            f"node={self.node_rank}/{self.num_nodes} master={self.master_addr}:{self.master_port} "
            f"({self.launched_by})"
        )


# --------------------------------------------------------------------------------------------- helpers


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` that is set and non-empty, as (name, value)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def node_count(environ: Mapping[str, str], name: str) -> int | None:
    """The node count in environment variable `name`, None when unset. A value that is not a whole number of
    at least 1 ("abc", "0") is refused: taken as unset, a launch silently used another count."""
    value = environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise LoomError(
            f"environment variable {name}={value!r} is not a node count (a whole number >= 1)",
            hint=f"unset {name} or fix what sets it (Slurm sets it to the job's number of nodes); "
            "--nnodes N gives the count by hand",
        )
    return int(value)


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    """The first of `names` that is set, as an int; `default` when none is."""
    found = _first(environ, *names)
    if found is None:
        return default
    name, value = found
    try:
        return int(value)
    except ValueError:
        raise LoomError(
            f"environment variable {name}={value!r} is not an integer",
            hint=f"unset {name} or fix the launcher that sets it",
        ) from None


def _require(value: int | None, what: str, names: tuple[str, ...]) -> int:
    if value is None:
        raise LoomError(
            f"the launcher set a rank but not the {what} ({' / '.join(names)})",
            hint="launch with torchrun, mpiexec or srun, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT",
        )
    return value


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list: `"nid[001-003,007],gpu5"` → `["nid001", "nid002", "nid003", "nid007", "gpu5"]`.

    Zero padding is kept (`[08-10]` → `08, 09, 10`); several bracket groups in one name expand as a
    product (`"r[1-2]n[1-2]"` → `r1n1, r1n2, r2n1, r2n2`). Nested brackets and step suffixes (`[1-9:2]`)
    are not Slurm node-list syntax and are rejected.
    """
    hosts: list[str] = []
    for name in _split_top_level(hostlist.strip()):
        parts = re.split(r"(\[[^\[\]]*\])", name)
        choices: list[list[str]] = []
        for part in parts:
            if part.startswith("[") and part.endswith("]"):
                choices.append(_expand_ranges(part[1:-1], hostlist))
            elif "[" in part or "]" in part:
                raise LoomError(
                    f"cannot parse host list {hostlist!r}", hint="expected e.g. nid[001-004,007],gpu5"
                )
            else:
                choices.append([part])
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            names.append(hostlist[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise LoomError(
                f"cannot parse host list {hostlist!r}", hint="expected e.g. nid[001-004,007],gpu5"
            )
    names.append(hostlist[start:])
    return [n.strip() for n in names if n.strip()]


def _expand_ranges(body: str, hostlist: str) -> list[str]:
    """`"001-003,7"` → `["001", "002", "003", "7"]`; the width of the lower bound sets the padding."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if m is None:
            raise LoomError(
                f"cannot parse host list {hostlist!r} at {item!r}", hint="expected e.g. nid[001-004,007]"
            )
        lo_text, hi_text = m.group(1), m.group(2)
        if hi_text is None:
            out.append(lo_text)
            continue
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise LoomError(
                f"descending range {item!r} in host list {hostlist!r}", hint="write ranges low-high"
            )
        width = len(lo_text)
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed per-node counts: `"4(x2),2"` → `[4, 4, 2]`."""
    counts: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise LoomError(f"cannot parse Slurm tasks-per-node value {text!r}", hint="expected e.g. 4(x2),2")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def read_hostfile(path: str | Path, option: str = "--hostfile") -> list[str]:
    """Unique hosts, in first-seen order, from a PBS nodefile or an MPI hostfile.

    Understands one host per line (PBS repeats a host once per MPI slot), `host:4` (MPICH) and
    `host slots=4` (Open MPI); blank lines and `#` comments are skipped. Raises `LoomError` when the
    file is missing or names no host, naming where the path came from: `option` (--hostfile, loom doctor's
    --nodes, or the PBS_NODEFILE variable).
    """
    path = Path(path)
    from loom.paths import check_not_endless

    check_not_endless(path, option)
    if option == "PBS_NODEFILE":
        remedy = (
            "PBS_NODEFILE is set by a PBS job: run inside the job that set it, or unset it outside one "
            "(and pass --hostfile FILE for other hosts)"
        )
    else:
        remedy = f"pass an existing file with one host per line to {option}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LoomError(
            f"cannot read host file {str(path)!r} ({option}): {exc.strerror or exc}", hint=remedy
        ) from None
    hosts: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host = line.split()[0].split(":", 1)[0]
        if host and host not in hosts:
            hosts.append(host)
    if not hosts:
        raise LoomError(
            f"host file {str(path)!r} ({option}) lists no hosts",
            hint="write one host name per line" if option != "PBS_NODEFILE" else remedy,
        )
    return hosts


def port_from_job_id(job_id: str | None) -> int:
    """A port every rank of a job agrees on: derived from the job id's digits, else torch's default 29500."""
    digits = re.match(r"\d+", job_id or "")
    if digits is None:
        return DEFAULT_MASTER_PORT
    return _PORT_BASE + int(digits.group()) % _PORT_SPAN


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it; it may be taken again once released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def slurm_hosts(environ: Mapping[str, str]) -> list[str]:
    """Hosts of the current Slurm step (or job), expanded; empty when no node list is set."""
    found = _first(environ, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    return expand_hostlist(found[1]) if found else []


def _pbs_hosts(environ: Mapping[str, str]) -> list[str]:
    """Hosts of the PBS nodefile; empty when it is not set or not readable on this node.

    Not an error here: ranks on sister nodes may not see the head node's nodefile, and they only
    need it for a default `MASTER_ADDR` that `loom launch` passes explicitly anyway.
    """
    path = environ.get("PBS_NODEFILE", "").strip()
    if not path:
        return []
    try:
        return read_hostfile(path, "PBS_NODEFILE")
    except LoomError:
        return []


# -------------------------------------------------------------------------------------------- detection


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read this process's rank, sizes and rendezvous address from the launcher's environment.

    `environ` defaults to `os.environ`; pass a dict to test. Raises `LoomError` when the variables
    contradict each other (a rank outside the world, a non-integer value).
    """
    environ = os.environ if environ is None else environ
    restarts = restart_count(environ)
    for detector in (_from_torchrun, _from_openmpi, _from_pmi, _from_slurm, _from_pbs):
        env = detector(environ)
        if env is not None:
            return replace(_validated(env), restarts=restarts)
    return DistEnv(0, 0, 1, 1, 0, 1, *_master(environ, [], None), source="none", restarts=restarts)


def _master(environ: Mapping[str, str], hosts: list[str], job_id: str | None) -> tuple[str, int]:
    addr = environ.get("MASTER_ADDR", "").strip() or (hosts[0] if hosts else "127.0.0.1")
    port = _int(environ, "MASTER_PORT")
    return addr, port if port is not None else port_from_job_id(job_id)


def _block_layout(rank: int, world: int, local_world: int) -> tuple[int, int]:
    """(node_rank, num_nodes) assuming ranks fill nodes in blocks, as mpiexec -ppn / srun do by default."""
    return rank // local_world, math.ceil(world / local_world)


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv | None:
    rank = _int(environ, "RANK")
    if rank is None:
        return None
    world = _require(_int(environ, "WORLD_SIZE"), "world size", ("WORLD_SIZE",))
    # Without LOCAL_* (a hand-written env:// launch) assume all ranks share one node.
    local_world = _int(environ, "LOCAL_WORLD_SIZE", default=world)
    local_rank = _int(environ, "LOCAL_RANK", default=rank % local_world)
    node_rank, num_nodes = _block_layout(rank, world, local_world)
    node_rank = _int(environ, "GROUP_RANK", default=node_rank)
    num_nodes = _int(environ, "GROUP_WORLD_SIZE", default=num_nodes)
    job_id = environ.get("TORCHELASTIC_RUN_ID") or environ.get("SLURM_JOB_ID") or environ.get("PBS_JOBID")
    addr, port = _master(environ, [], job_id)
    return DistEnv(
        rank,
        local_rank,
        world,
        local_world,
        node_rank,
        num_nodes,
        addr,
        port,
        "torchrun",
        0,
        _launcher(environ),
    )


def _launcher(environ: Mapping[str, str]) -> str:
    """Who set torchrun's variables: `loom train --nproc` (its workers carry LOOM_NPROC_JOB, the job id it gave
    TORCHELASTIC_RUN_ID: a torchrun started below one of them is torchrun again), torchrun (its agent sets
    TORCHELASTIC_RUN_ID), else a hand-written env:// launch."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and environ.get("LOOM_NPROC_JOB") == run_id:
        return "loom --nproc"
    return "torchrun" if run_id else "env:// (RANK and WORLD_SIZE set by hand)"


def _scheduler_hosts_and_job(environ: Mapping[str, str]) -> tuple[list[str], str | None]:
    """Where an MPI job runs, for a default master address: the Slurm node list, else the PBS nodefile."""
    if environ.get("SLURM_JOB_ID"):
        return slurm_hosts(environ), environ["SLURM_JOB_ID"]
    if environ.get("PBS_JOBID"):
        return _pbs_hosts(environ), environ["PBS_JOBID"]
    return [], None


def _from_openmpi(environ: Mapping[str, str]) -> DistEnv | None:
    rank = _int(environ, "OMPI_COMM_WORLD_RANK")
    if rank is None:
        return None
    world = _require(_int(environ, "OMPI_COMM_WORLD_SIZE"), "world size", ("OMPI_COMM_WORLD_SIZE",))
    local_rank = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
    local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", default=1)
    # Not OMPI_COMM_WORLD_NODE_RANK: Open MPI documents it as this process's rank on its node counted
    # across all jobs, not the node's index, so the node index comes from the block layout.
    node_rank, num_nodes = _block_layout(rank, world, local_world)
    hosts, job_id = _scheduler_hosts_and_job(environ)
    addr, port = _master(environ, hosts, job_id)
    return DistEnv(rank, local_rank, world, local_world, node_rank, num_nodes, addr, port, "openmpi")


_PMI_RANK = ("PMI_RANK", "PMIX_RANK", "PALS_RANKID")
_PMI_SIZE = ("PMI_SIZE",)
_PMI_LOCAL_RANK = ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID")
_PMI_LOCAL_SIZE = ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE")


def _from_pmi(environ: Mapping[str, str]) -> DistEnv | None:
    rank = _int(environ, *_PMI_RANK)
    if rank is None:
        return None
    world = _int(environ, *_PMI_SIZE)
    local_world = _int(environ, *_PMI_LOCAL_SIZE)
    if (world is None or local_world is None) and _first(environ, "SLURM_STEP_ID", "SLURM_STEPID"):
        # srun --mpi=pmix / pmi2 set a rank but not every size; the Slurm step describes itself fully.
        return None
    world = _require(world, "world size", _PMI_SIZE)
    if local_world is None:  # no per-node count from this launcher: one node is the only safe guess
        local_world = world
    local_rank = _int(environ, *_PMI_LOCAL_RANK, default=rank % local_world)
    node_rank, num_nodes = _block_layout(rank, world, local_world)
    node_rank = _int(environ, "PALS_NODEID", default=node_rank)  # Cray PALS says which node it is
    hosts, job_id = _scheduler_hosts_and_job(environ)
    addr, port = _master(environ, hosts, job_id)
    return DistEnv(rank, local_rank, world, local_world, node_rank, num_nodes, addr, port, "mpich/pmi")


def _from_slurm(environ: Mapping[str, str]) -> DistEnv | None:
    rank = _int(environ, "SLURM_PROCID")
    # A batch script also sees SLURM_PROCID=0 and the job's SLURM_NTASKS, but it is one process, not a
    # step of N tasks; only srun sets SLURM_STEP_ID, so without it this is not a Slurm launch.
    if rank is None or not _first(environ, "SLURM_STEP_ID", "SLURM_STEPID"):
        return None
    world = _require(
        _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), "task count", ("SLURM_NTASKS",)
    )
    found = _first(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    num_nodes = node_count(environ, found[0]) if found else 1  # "0" divided the tasks by zero below
    node_rank = _int(environ, "SLURM_NODEID", default=0)
    local_rank = _int(environ, "SLURM_LOCALID", default=0)
    per_node = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    if per_node is not None:
        counts = parse_tasks_per_node(per_node[1])
        local_world = counts[node_rank] if node_rank < len(counts) else counts[-1]
    else:
        local_world = math.ceil(world / num_nodes)
    hosts = slurm_hosts(environ)
    addr, port = _master(environ, hosts, environ.get("SLURM_JOB_ID"))
    return DistEnv(rank, local_rank, world, local_world, node_rank, num_nodes, addr, port, "slurm")


def _from_pbs(environ: Mapping[str, str]) -> DistEnv | None:
    # PBS starts the job script once, on the first host of the nodefile; ranks come from mpiexec.
    if not (environ.get("PBS_JOBID") or environ.get("PBS_NODEFILE")):
        return None
    hosts = _pbs_hosts(environ)
    addr, port = _master(environ, hosts, environ.get("PBS_JOBID"))
    return DistEnv(0, 0, 1, 1, 0, 1, addr, port, "pbs")


def _validated(env: DistEnv) -> DistEnv:
    checks = (
        (env.world_size >= 1, f"world size {env.world_size} < 1"),
        (0 <= env.rank < env.world_size, f"rank {env.rank} outside world size {env.world_size}"),
        (env.local_world_size >= 1, f"local world size {env.local_world_size} < 1"),
        (
            0 <= env.local_rank < env.local_world_size,
            f"local rank {env.local_rank} outside local world size {env.local_world_size}",
        ),
        (env.num_nodes >= 1, f"node count {env.num_nodes} < 1"),
        (0 <= env.node_rank < env.num_nodes, f"node rank {env.node_rank} outside node count {env.num_nodes}"),
        (0 < env.master_port < 65536, f"master port {env.master_port} outside 1-65535"),
    )
    for ok, problem in checks:
        if not ok:
            raise LoomError(
                f"inconsistent {env.source} launch environment: {problem}",
                hint="check the launcher's variables (env | grep -E 'RANK|SIZE|SLURM|PMI|OMPI')",
            )
    return env


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times torch elastic's agent has restarted this job's workers (TORCHELASTIC_RESTART_COUNT; 0 on
    the first attempt and under any other launcher)."""
    environ = os.environ if environ is None else environ
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, as taskset or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity on macOS
        return os.cpu_count() or 1


def oversubscription(nproc: int, option: str = "--nproc") -> str | None:
    """A warning when `nproc` local processes would share fewer CPU cores than that, else None."""
    cores = usable_cores()
    if nproc <= cores:
        return None
    return (
        f"{option} {nproc} starts {nproc} processes on the {cores} CPU core{'s' * (cores != 1)} this process "
        f"may use (os.sched_getaffinity): each gets about {cores / nproc:.2g} of a core, so expect it to be "
        f"slow (use at most {cores} on this machine unless that is what you want)"
    )


# glibc's malloc options (<malloc.h>) and the defaults that mallopt(3) documents for them
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536


def cpu_memory_release(trim_threshold: int | None = None) -> bool:
    """From now on glibc's malloc serves every block of 1 MiB or more with mmap and unmaps it when freed.

    By default glibc raises that threshold (up to 32 MiB) each time such a block is freed, after which blocks
    of tens of MB come from the heap, which fragments and keeps them. A sharded (FSDP) forward on CPU
    all-gathers each block's parameters into buffers of that size, once per block: measured on a
    170M-parameter model (24 blocks) evaluated by 2 ranks, the peak per rank was 1.64 GB, more than the whole
    model in one process (1.07 GB); with the fixed threshold 0.84 GB. `trim_threshold` (bytes), when given,
    also sets how much free memory at the top of the heap glibc keeps before giving it back. Returns whether
    it applied (glibc)."""
    libc = glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)  # setting it also stops glibc's dynamic adjustment
        if trim_threshold is not None:
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold)
    return libc is not None


@contextlib.contextmanager
def cpu_memory_reuse(enabled: bool = True):
    """Within it, glibc's malloc keeps freed memory for reuse: no mmap for large blocks, no trimming.

    A training step's activations are tensors of tens of MB; glibc serves blocks that large with mmap and
    unmaps them when freed, so every step page-faults all its activations in again: ~20% of a step of the
    6-layer Tiny Shakespeare model on 2 CPU cores. Equivalent to starting the process with
    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1073741824. The resident size stays
    at its peak meanwhile; glibc's static defaults come back on exit. A no-op without glibc (macOS, musl)."""
    libc = glibc() if enabled else None
    if libc is not None:
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield libc is not None
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)


def glibc():
    """glibc through ctypes, or None (another libc, another system)."""
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        try:
            return ctypes.CDLL("libc.so.6")
        except OSError:
            return None
    return None


def native_bf16_cpu() -> bool:
    """Whether this CPU has bf16 arithmetic units (AVX512-BF16 or AMX), from Linux's /proc/cpuinfo flags."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
