"""Where is `loom launch` running: inside a Slurm or PBS allocation, over a given hostfile, or on its own.

Layer 1, standard library only (never torch): the launcher must start fast on a login or head node.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loom.env import expand_hostlist, node_count, read_hostfile
from loom.errors import LoomError

SCHEDULERS = ("slurm", "pbs", "hostfile", "none")


@dataclass(frozen=True)
class Allocation:
    """The machines this launch may use.

    `hosts` are unique, in scheduler order (the first is the head node, where rank 0 runs);
    `hostfile` is the file mpiexec should read (the PBS nodefile or the user's), else None.
    """

    scheduler: str  # one of SCHEDULERS
    hosts: tuple[str, ...] = ()
    job_id: str | None = None
    hostfile: str | None = None

    @property
    def num_nodes(self) -> int:
        return max(1, len(self.hosts))

    @property
    def head(self) -> str | None:
        return self.hosts[0] if self.hosts else None


def detect_allocation(environ: Mapping[str, str] | None = None, hostfile: str | None = None) -> Allocation:
    """Detect the scheduler and its hosts.

    An explicit `hostfile` wins (the user asked for those machines); then a Slurm allocation
    (`SLURM_JOB_ID` with a node list), then PBS (`PBS_NODEFILE`), else none: this machine alone.
    Raises `LoomError` when the hostfile or the PBS nodefile is missing or empty.
    """
    environ = os.environ if environ is None else environ
    if hostfile:
        return Allocation("hostfile", tuple(read_hostfile(hostfile)), environ.get("PBS_JOBID"), str(hostfile))
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    nodelist = environ.get("SLURM_JOB_NODELIST", "").strip() or environ.get("SLURM_NODELIST", "").strip()
    if job_id and nodelist:
        node_count(environ, "SLURM_NNODES")  # never read here (the node list is), but garbage is refused
        return Allocation("slurm", tuple(expand_hostlist(nodelist)), job_id)
    nodefile = environ.get("PBS_NODEFILE", "").strip()
    if nodefile:
        hosts = read_hostfile(nodefile, "PBS_NODEFILE")  # set by PBS, not by an option
        return Allocation("pbs", tuple(hosts), environ.get("PBS_JOBID", "").strip() or None, nodefile)
    return Allocation("none")


def node_task(environ: Mapping[str, str] | None = None) -> tuple[int, int | None] | None:
    """(this node's index, the node count or None) when the scheduler started this process once per node.

    That is how a job starts `loom launch` on every host: `srun --ntasks-per-node=1 loom launch ...`
    inside a Slurm allocation (a step: `SLURM_STEP_ID`, `SLURM_NODEID`, `SLURM_NNODES`), or
    `pbsdsh -u loom launch ...` under PBS (`PBS_NODENUM`). Then loom launch runs torchrun for this node
    only, instead of starting srun or mpiexec again. None otherwise (a batch script, a login node).
    """
    environ = os.environ if environ is None else environ

    def number(name: str) -> int | None:
        value = environ.get(name, "").strip()
        return int(value) if value.isdigit() else None

    if environ.get("SLURM_JOB_ID") and (
        number("SLURM_STEP_ID") is not None or number("SLURM_STEPID") is not None
    ):
        node = number("SLURM_NODEID")
        if node is not None:
            local = number("SLURM_LOCALID")
            if local not in (None, 0):
                raise LoomError(
                    "srun started several tasks on this node, and each would start its own loom launch",
                    hint="start one task per node: srun --ntasks-per-node=1 loom launch ...",
                )
            return node, node_count(environ, "SLURM_STEP_NUM_NODES") or node_count(environ, "SLURM_NNODES")
    if environ.get("PBS_NODEFILE") and number("PBS_NODENUM") is not None:
        return number("PBS_NODENUM"), None  # type: ignore[return-value]
    return None


def count_local_gpus(environ: Mapping[str, str] | None = None, dev_dir: str | Path = "/dev") -> int:
    """GPUs on this machine, found without importing torch; 0 when none are visible.

    `CUDA_VISIBLE_DEVICES` wins when set (a scheduler may have given this job a subset); otherwise the
    NVIDIA device nodes `/dev/nvidia0`, `/dev/nvidia1`, ... are counted.
    """
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid index, and "-1" is the usual way to hide every GPU.
        count = 0
        for entry in entries:
            if entry.startswith("-"):
                break
            count += 1
        return count
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return 0
    return sum(1 for name in names if re.fullmatch(r"nvidia\d+", name))


def default_nproc_per_node(environ: Mapping[str, str] | None = None, dev_dir: str | Path = "/dev") -> int:
    """One process per visible GPU, or 1 on a machine without GPUs."""
    return max(1, count_local_gpus(environ, dev_dir))
