"""Command lines for torchrun, mpiexec and srun (layer 1, standard library only, never torch).

Every builder is a pure function of its arguments, so each cluster's command can be unit-tested on a
laptop; only `detect_mpi_flavour()` runs a program (`mpiexec --version`).

Which launcher on which cluster (`resolve_launcher`):

| scheduler | auto     | torchrun on several nodes                               |
|-----------|----------|---------------------------------------------------------|
| slurm     | srun     | `srun --nodes N --ntasks N --ntasks-per-node 1 torchrun ...` |
| pbs       | mpiexec  | `mpiexec -n N -ppn 1 --hostfile $PBS_NODEFILE torchrun ...`  |
| hostfile  | mpiexec  | as PBS, with the user's hostfile                        |
| none      | torchrun | `torchrun --rdzv-endpoint HEAD:PORT ...`, run on every node by hand |

Ranks started by mpiexec or srun find their rank in the launcher's variables (`loom.env`); the
rendezvous address is passed to them through `env MASTER_ADDR=... MASTER_PORT=...` in front of the
user command, so they agree on it even where the PBS nodefile is readable on the head node only, and
so that Open MPI, which forwards no environment by default, behaves like MPICH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from loom.env import DEFAULT_MASTER_PORT
from loom.errors import LoomError

LAUNCHERS = ("auto", "torchrun", "mpiexec", "srun")
MPI_FLAVOURS = ("mpich", "openmpi")  # mpich covers Hydra, Intel MPI, MVAPICH and Cray PALS (-n / -ppn)
_AUTO = {"slurm": "srun", "pbs": "mpiexec", "hostfile": "mpiexec", "none": "torchrun"}


def resolve_launcher(requested: str, scheduler: str) -> str:
    """The concrete launcher: `requested` itself, or for `auto` the natural one for `scheduler`."""
    if requested not in LAUNCHERS:
        raise LoomError(f"unknown launcher {requested!r}", hint=f"use one of: {', '.join(LAUNCHERS)}")
    if requested != "auto":
        return requested
    if scheduler not in _AUTO:
        raise LoomError(f"unknown scheduler {scheduler!r}", hint=f"expected one of: {', '.join(_AUTO)}")
    return _AUTO[scheduler]


def uses_mpiexec(launcher: str, scheduler: str, nnodes: int) -> bool:
    """Whether `build_command` will run mpiexec (directly, or to start one torchrun per node)."""
    return launcher == "mpiexec" or (
        launcher == "torchrun" and scheduler in ("pbs", "hostfile") and nnodes > 1
    )


def _check_counts(nnodes: int, nproc_per_node: int) -> None:
    if nnodes < 1 or nproc_per_node < 1:
        raise LoomError(
            f"need at least one node and one process per node, got nnodes={nnodes} nproc_per_node={nproc_per_node}",
            hint="pass --nnodes and --nproc-per-node as positive integers",
        )


def _check_command(command: Sequence[str]) -> None:
    if not command:
        raise LoomError(
            "no command to launch", hint="put the command after --, e.g. loom launch -- loom train"
        )


def with_rendezvous(command: Sequence[str], port: int, head_addr: str | None = None) -> list[str]:
    """`env [MASTER_ADDR=HEAD] MASTER_PORT=PORT command...`: the rendezvous point, on every rank."""
    assignments = ([f"MASTER_ADDR={head_addr}"] if head_addr else []) + [f"MASTER_PORT={port}"]
    return ["env", *assignments, *command]


def torchrun_command(
    command: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    head_addr: str | None = None,
    port: int = DEFAULT_MASTER_PORT,
    job_id: str | None = None,
    is_host: bool | None = None,
    rdzv_timeout: float | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """One torchrun (run once per node) that starts `nproc_per_node` workers.

    One node → `--standalone` (torchrun picks a free local port itself). Several nodes → a c10d
    rendezvous at `head_addr:port` under id `job_id`, which every node must share. `is_host` says
    whether this node serves the rendezvous store (known when the scheduler gives the node index;
    otherwise torchrun guesses from the address); `rdzv_timeout` is how long a node waits for the
    others to join; `max_restarts` how often the agents restart every worker after a failure. A command
    that is not a `.py` script (`loom train`, `python -m loom train`) is run as is through `--no-python`.
    """
    _check_counts(nnodes, nproc_per_node)
    _check_command(command)
    cmd = ["torchrun"]
    if nnodes == 1:
        cmd += ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc_per_node)]
    else:
        if not head_addr:
            raise LoomError(
                f"torchrun on {nnodes} nodes needs the head node's address",
                hint="run inside a Slurm or PBS job, pass --hostfile, or pass --master-addr HOST "
                "(the node of rank 0) and run the same loom launch on every node",
            )
        cmd += [
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc_per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{head_addr}:{port}",
            "--rdzv-id",
            job_id or "loom",
        ]
        conf = ([f"is_host={int(is_host)}"] if is_host is not None else []) + (
            [f"join_timeout={rdzv_timeout:g}"] if rdzv_timeout else []
        )
        if conf:
            cmd += ["--rdzv-conf", ",".join(conf)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
        if nnodes > 1:
            # A node that comes back joins the next round, but with the rendezvous store shared with the
            # workers (torch's default) the round never completes: the new agent waits for MASTER_ADDR and
            # the old one for role_info, until the join timeout (torch 2.13, two namespace hosts).
            cmd = ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", *cmd]
    if not command[0].endswith(".py"):
        cmd.append("--no-python")
    return cmd + list(command)


def mpiexec_command(
    command: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    hostfile: str | None = None,
    flavour: str = "mpich",
    as_root: bool = False,
) -> list[str]:
    """`mpiexec` for `nnodes × nproc_per_node` ranks, `nproc_per_node` on each host of `hostfile`.

    `flavour="mpich"` (Hydra, Intel MPI, Cray PALS on Polaris / Aurora): `-n TOTAL -ppn G --hostfile F`.
    `flavour="openmpi"`: `-np TOTAL -npernode G --hostfile F`, plus `--allow-run-as-root --oversubscribe`
    when `as_root` (Open MPI refuses root, which containers often are, without them).
    """
    _check_counts(nnodes, nproc_per_node)
    _check_command(command)
    total = str(nnodes * nproc_per_node)
    if flavour == "mpich":
        cmd = ["mpiexec", "-n", total, "-ppn", str(nproc_per_node)]
    elif flavour == "openmpi":
        cmd = ["mpiexec", "-np", total, "-npernode", str(nproc_per_node)]
    else:
        raise LoomError(f"unknown MPI flavour {flavour!r}", hint=f"use one of: {', '.join(MPI_FLAVOURS)}")
    if hostfile:
        cmd += ["--hostfile", str(hostfile)]
    if flavour == "openmpi" and as_root:
        cmd += ["--allow-run-as-root", "--oversubscribe"]
    return cmd + list(command)


def srun_command(
    command: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    nodelist: Sequence[str] | None = None,
) -> list[str]:
    """`srun --nodes N --ntasks-per-node G` (with `--ntasks N·G`, which overrides a job's inherited
    `SLURM_NTASKS`; and `--nodelist` to pin the step to given hosts)."""
    _check_counts(nnodes, nproc_per_node)
    _check_command(command)
    cmd = [
        "srun",
        "--nodes",
        str(nnodes),
        "--ntasks",
        str(nnodes * nproc_per_node),
        "--ntasks-per-node",
        str(nproc_per_node),
    ]
    if nodelist:
        cmd += ["--nodelist", ",".join(nodelist)]
    return cmd + list(command)


def build_command(
    launcher: str,
    command: Sequence[str],
    *,
    nnodes: int,
    nproc_per_node: int,
    scheduler: str = "none",
    hosts: Sequence[str] = (),
    hostfile: str | None = None,
    head_addr: str | None = None,
    port: int = DEFAULT_MASTER_PORT,
    job_id: str | None = None,
    mpi_flavour: str = "mpich",
    as_root: bool = False,
    max_restarts: int = 0,
) -> list[str]:
    """The full command line that starts `command` on `nnodes × nproc_per_node` processes.

    `launcher` is `auto`, `torchrun`, `mpiexec` or `srun`; `scheduler` and `hosts` come from
    `detect_allocation()`. Under Slurm torchrun runs once per node through srun; under PBS or a
    hostfile, on several nodes, once per node through mpiexec.
    """
    launcher = resolve_launcher(launcher, scheduler)
    _check_counts(nnodes, nproc_per_node)
    _check_command(command)
    if hosts and nnodes > len(hosts):
        raise LoomError(
            f"asked for {nnodes} nodes but the {scheduler} allocation has {len(hosts)}",
            hint=f"pass --nnodes {len(hosts)} or fewer, or ask the scheduler for more nodes",
        )
    # Pin a Slurm step that uses part of the allocation to its first hosts, so the head is in it.
    nodelist = list(hosts[:nnodes]) if scheduler == "slurm" and 0 < nnodes < len(hosts) else None

    if launcher == "srun":
        # No MASTER_ADDR: each rank takes the first host of its own step (SLURM_STEP_NODELIST).
        return srun_command(
            with_rendezvous(command, port), nnodes=nnodes, nproc_per_node=nproc_per_node, nodelist=nodelist
        )
    if launcher == "mpiexec":
        if scheduler in ("pbs", "hostfile") and not hostfile:
            raise LoomError(f"mpiexec under {scheduler} needs its hostfile", hint="pass --hostfile FILE")
        if scheduler == "none" and nnodes > 1 and not hostfile:
            raise LoomError(
                f"mpiexec on {nnodes} nodes needs a hostfile",
                hint="pass --hostfile FILE with one host per line, or run inside a Slurm or PBS job",
            )
        # With a hostfile, rank 0 runs on its first host; without one (Slurm, one node) each rank decides.
        inner = with_rendezvous(command, port, head_addr if hostfile else None)
        return mpiexec_command(
            inner,
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            hostfile=hostfile,
            flavour=mpi_flavour,
            as_root=as_root,
        )
    # torchrun
    torchrun = torchrun_command(
        command,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        head_addr=head_addr,
        port=port,
        job_id=job_id,
        max_restarts=max_restarts,
    )
    if scheduler == "slurm":
        return srun_command(torchrun, nnodes=nnodes, nproc_per_node=1, nodelist=nodelist)
    if uses_mpiexec(launcher, scheduler, nnodes):
        return mpiexec_command(
            torchrun, nnodes=nnodes, nproc_per_node=1, hostfile=hostfile, flavour=mpi_flavour, as_root=as_root
        )
    return torchrun


def find_mpiexec() -> str | None:
    """mpiexec beside the interpreter (where the `mpich` wheel of loom[mpi] puts it), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def local_mpiexec(command: Sequence[str], nproc: int) -> list[str]:
    """`mpiexec` for nproc ranks on this machine, with Open MPI's root flags when they are needed."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise LoomError(
            "mpiexec not found", hint="pip install 'loom[mpi]' (brings MPICH), or load your MPI module"
        )
    flavour = detect_mpi_flavour(mpiexec)
    cmd = mpiexec_command(command, nnodes=1, nproc_per_node=nproc, flavour=flavour, as_root=os.geteuid() == 0)
    return [mpiexec, *cmd[1:]]


def parse_mpi_flavour(version_text: str) -> str:
    """`openmpi` when `mpiexec --version` names Open MPI (or its runtimes ORTE / PRRTE), else `mpich`."""
    text = version_text.lower()
    if any(mark in text for mark in ("open mpi", "openrte", "open-mpi", "prrte")):
        return "openmpi"
    return "mpich"


def detect_mpi_flavour(executable: str = "mpiexec") -> str:
    """Run `executable --version` and classify it with `parse_mpi_flavour`."""
    path = shutil.which(executable)
    if path is None:
        raise LoomError(
            f"{executable} not found on PATH",
            hint="install MPI (pip install 'loom[mpi]' brings MPICH), load your cluster's MPI module, "
            "or pass --launcher torchrun",
        )
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LoomError(
            f"could not run {executable} --version: {exc}",
            hint="pass --mpi-flavour mpich or --mpi-flavour openmpi",
        ) from None
    return parse_mpi_flavour(result.stdout + result.stderr)
