"""`loom launch`: one command that starts a training run on any cluster (layer 1, never imports torch).

    loom launch [--launcher auto|torchrun|mpiexec|srun] [--nnodes N] [--nproc-per-node G]
                [--hostfile F] [--port P] [--master-addr HOST] [--mpi-flavour auto|mpich|openmpi]
                [--node-rank I] [--rdzv-timeout S] [--max-restarts R] [--dry-run] -- loom train ...

The scheduler is detected (`detect.py`), the launcher chosen and its command line built
(`commands.py`); `--dry-run` prints that command instead of running it. Started once per node (inside
an srun step, under pbsdsh, or with --node-rank), it runs this node's torchrun, after every node has
checked in with node 0 (`gate.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from loom import log
from loom.env import port_from_job_id, slurm_hosts
from loom.errors import LoomError
from loom.launch import ft
from loom.launch.commands import (
    LAUNCHERS,
    MPI_FLAVOURS,
    build_command,
    detect_mpi_flavour,
    resolve_launcher,
    torchrun_command,
    uses_mpiexec,
)
from loom.launch.detect import Allocation, default_nproc_per_node, detect_allocation, node_task
from loom.launch.gate import head_gate, local_hello, node_gate

__all__ = ["launch_main", "plan_command", "Allocation", "build_command", "detect_allocation"]

_USAGE_HINT = "loom launch --nproc-per-node 4 -- loom train configs/x.toml"


class _Parser(argparse.ArgumentParser):
    """argparse that raises LoomError (printed with a hint by the CLI) instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise LoomError(f"loom launch: {message}", hint=f"usage: {_USAGE_HINT}  (see loom launch --help)")


def _parser() -> _Parser:
    p = _Parser(
        prog="loom launch",
        usage="loom launch [options] -- COMMAND [ARGS ...]",
        description="Start a command on every process of the job, with the right launcher for this cluster.",
        epilog=f"example: {_USAGE_HINT}",
    )
    p.add_argument(
        "--launcher",
        default="auto",
        help=f"one of {', '.join(LAUNCHERS)}; auto: srun under Slurm, mpiexec under PBS or with "
        "--hostfile, torchrun otherwise",
    )
    p.add_argument(
        "--nnodes", type=int, default=None, help="nodes to use (default: all of the allocation, or 1)"
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes per node (default: visible GPUs, counted without torch, or 1)",
    )
    p.add_argument("--hostfile", default=None, help="hosts to run on, one per line (PBS nodefile format)")
    p.add_argument(
        "--port", type=int, default=None, help="rendezvous port (default: from the job id, or 29500)"
    )
    p.add_argument(
        "--master-addr",
        default=None,
        help="head node address for torchrun on several nodes without a scheduler (default: $MASTER_ADDR)",
    )
    p.add_argument(
        "--mpi-flavour",
        default="auto",
        help="mpiexec dialect: auto (ask mpiexec --version), mpich (also Intel MPI, Cray PALS) or openmpi",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's index when loom launch runs on every node (default: SLURM_NODEID inside an srun "
        "step, PBS_NODENUM under pbsdsh); node 0 serves the rendezvous",
    )
    p.add_argument(
        "--rdzv-timeout",
        type=float,
        default=600,
        help="seconds the nodes wait for each other at the start (default 600, torchrun's)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts every worker this many times after a failure (a node that comes back "
        "rejoins); add --train.resume=auto to the command so the restart continues from the last checkpoint",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    return p


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(loom launch's options, the command after `--`); the command is empty when there is no `--`."""
    if "--" not in argv:
        return list(argv), []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def plan_command(argv: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The command `loom launch argv` would run, detected from `environ` (default `os.environ`)."""
    return _plan(argv, os.environ if environ is None else environ)[0]


def _plan(argv: list[str], environ: Mapping[str, str]) -> tuple[list[str], argparse.Namespace]:
    options, command = _split_command(argv)
    parser = _parser()
    if "--" not in argv and not {"-h", "--help"} & set(argv):
        raise LoomError("loom launch: no command; put it after --", hint=_USAGE_HINT)
    args = parser.parse_args(options)  # --help exits here, before the command is required
    if not command:
        raise LoomError("loom launch: nothing after -- to launch", hint=_USAGE_HINT)

    allocation = detect_allocation(environ, hostfile=args.hostfile)
    task = node_task(environ)
    if args.node_rank is not None:
        task = (args.node_rank, task[1] if task else None)
    launcher = _launcher(args, allocation, task)
    nnodes = args.nnodes if args.nnodes is not None else (task and task[1]) or allocation.num_nodes
    nproc = args.nproc_per_node if args.nproc_per_node is not None else default_nproc_per_node(environ)
    for option, value in (("--nnodes", nnodes), ("--nproc-per-node", nproc)):  # one error per bad option
        if value < 1:
            raise LoomError(
                f"{option} must be at least 1, got {value}",
                hint=f"leave {option} out to use the whole allocation and every visible GPU",
            )
    port = _port(args, environ, allocation)
    hosts = allocation.hosts
    if task is not None and allocation.scheduler == "slurm":
        hosts = tuple(slurm_hosts(environ))  # the step's nodes (SLURM_STEP_NODELIST) when it runs on a subset
    head_addr = args.master_addr or environ.get("MASTER_ADDR", "").strip() or (hosts[0] if hosts else None)
    _check_restarts(args)
    args.node = args.lighthouse = None
    if ft.is_ft(command):  # torchft replica groups: one a node (loom.launch.ft)
        return _ft_plan(
            args, command, allocation.scheduler, task, (nnodes, nproc, port, head_addr, hosts)
        ), args
    if task is not None:
        args.node = _PerNode(task[0], nnodes, nproc, head_addr, port, hosts)
        return _per_node_command(args.node, command, allocation.job_id, args), args
    if args.max_restarts and launcher != "torchrun":
        raise LoomError(
            f"--max-restarts needs torchrun's elastic agent, not {launcher}",
            hint="run loom launch on every node (srun --ntasks-per-node=1 loom launch ..., pbsdsh -u ...), "
            "or pass --launcher torchrun",
        )
    mpi_flavour = _mpi_flavour(args.mpi_flavour, launcher, allocation, nnodes)
    cmd = build_command(
        launcher,
        command,
        nnodes=nnodes,
        nproc_per_node=nproc,
        scheduler=allocation.scheduler,
        hosts=allocation.hosts,
        hostfile=allocation.hostfile,
        head_addr=head_addr,
        port=port,
        job_id=allocation.job_id,
        mpi_flavour=mpi_flavour,
        as_root=_as_root(),
        max_restarts=args.max_restarts,
    )
    return cmd, args


def _ft_plan(args, command: list[str], scheduler: str, task, job: tuple) -> list[str]:
    """An ft job's command: `loom train --nproc G` on one node; else this node's group (its own standalone
    torchrun, its number and the lighthouse in the environment; node 0 serves the lighthouse), or under a
    scheduler loom launch itself once per node."""
    nnodes, nproc, port, head_addr, hosts = job
    ft.run_name(command)
    if task is None:
        if nnodes == 1:
            return ft.local_command(command, nproc)
        return ft.per_node_launch(scheduler, nnodes, nproc, port, head_addr, command)
    node = task[0]
    if not 0 <= node < nnodes:
        raise LoomError(
            f"node index {node} is outside the {nnodes} node(s) of this job",
            hint="pass --node-rank 0 on the head node and 1 .. N-1 on the others, with --nnodes N",
        )
    url = ft.option(command, "ft.lighthouse")
    if not url:
        bind = ft.lighthouse_bind(head_addr, nnodes, port)
        url = f"http://{'127.0.0.1' if nnodes == 1 else head_addr}:{bind.rsplit(':', 1)[1]}"
        args.lighthouse = ft.lighthouse_command(bind, command) if node == 0 else None
    args.node = _PerNode(node, nnodes, nproc, head_addr, port, hosts)
    group = ft.group_command(command, node, nnodes)
    torchrun = torchrun_command(group, nnodes=1, nproc_per_node=nproc, max_restarts=args.max_restarts)
    return [*ft.group_env(node, url), *torchrun]


def _launcher(args, allocation, task) -> str:
    """The launcher asked (or found for the scheduler); torchrun when loom launch runs on every node."""
    launcher = resolve_launcher(args.launcher, allocation.scheduler)
    if task is None:
        return launcher
    if args.launcher not in ("auto", "torchrun"):
        raise LoomError(
            f"--launcher {args.launcher} on every node: loom launch runs once per node here "
            f"(node {task[0]}), so it starts this node's torchrun",
            hint="leave --launcher out, or run loom launch once (on the head node or in the batch script)",
        )
    return "torchrun"


def _port(args, environ: Mapping[str, str], allocation) -> int:
    """--port, else MASTER_PORT, else one derived from the job id; refused outside 1-65535."""
    port, port_from = args.port, "--port"
    if port is None and environ.get("MASTER_PORT", "").isdigit():
        port, port_from = int(environ["MASTER_PORT"]), "MASTER_PORT"
    if port is None:
        port = port_from_job_id(allocation.job_id)
    if not 0 < port < 65536:
        raise LoomError(
            f"{port_from} {port} is not a TCP port",
            hint=f"pick a port in 1024-65535 for {port_from}, e.g. 29500",
        )
    return port


def _check_restarts(args) -> None:
    if not args.rdzv_timeout > 0:
        raise LoomError(
            f"--rdzv-timeout must be > 0 seconds, got {args.rdzv_timeout}", hint="e.g. --rdzv-timeout 300"
        )
    if args.max_restarts < 0:
        raise LoomError(f"--max-restarts must be >= 0, got {args.max_restarts}", hint="0: no restarts")


def _mpi_flavour(asked: str, launcher: str, allocation, nnodes: int) -> str:
    """--mpi-flavour, or (auto) the installed MPI's when the command goes through mpiexec, else mpich."""
    if asked not in ("auto", *MPI_FLAVOURS):
        raise LoomError(f"unknown --mpi-flavour {asked!r}", hint=f"use auto, {' or '.join(MPI_FLAVOURS)}")
    if asked == "auto":
        return detect_mpi_flavour() if uses_mpiexec(launcher, allocation.scheduler, nnodes) else "mpich"
    return asked


def _per_node_command(job: _PerNode, command: list[str], job_id: str | None, args) -> list[str]:
    """This node's torchrun, when loom launch runs on every node; node 0 serves the rendezvous."""
    if not 0 <= job.node < job.nnodes:
        raise LoomError(
            f"node index {job.node} is outside the {job.nnodes} node(s) of this job",
            hint="pass --node-rank 0 on the head node and 1 .. N-1 on the others, with --nnodes N",
        )
    several = job.nnodes > 1
    return torchrun_command(
        command,
        nnodes=job.nnodes,
        nproc_per_node=job.nproc,
        head_addr=job.head_addr,
        port=job.port,
        job_id=job_id,
        is_host=job.node == 0 if several else None,
        rdzv_timeout=args.rdzv_timeout if several else None,
        max_restarts=args.max_restarts,
    )


@dataclass(frozen=True)
class _PerNode:
    """loom launch running on every node: which one this is, and where they meet."""

    node: int
    nnodes: int
    nproc: int
    head_addr: str
    port: int
    hosts: tuple[str, ...]


def _gate(job: _PerNode, timeout: float, rejoin: bool) -> None:
    """Every node checks in with the head before torchrun starts (`gate.py`); node 0 logs who came."""
    hello = local_hello(job.node, job.nproc)
    if job.node == 0:
        hellos = head_gate(job.head_addr, job.port, job.nnodes, hello, timeout, job.hosts)
        log.info(
            f"loom launch: {job.nnodes} nodes checked in at {job.head_addr}:{job.port}: "
            + ", ".join(f"{h.host} ({h.nproc} proc)" for h in hellos)
            + f"; loom {hello.loom}, torch {hello.torch}"
        )
    else:
        node_gate(job.head_addr, job.port, hello, timeout, job.hosts, rejoin=rejoin)


def launch_main(argv: list[str]) -> int:
    """Entry point of `loom launch`: build the command for this cluster, then print or run it.

    Returns the launched command's exit code (0 after `--dry-run` or `--help`). User mistakes (no
    command after `--`, a missing or empty hostfile, an unknown launcher, counts below 1, torchrun on
    several nodes without a head address) raise `LoomError` with a hint.
    """
    try:
        cmd, args = _plan(argv, os.environ)
    except SystemExit as exc:  # --help printed its text
        return int(exc.code or 0)
    line = shlex.join(cmd)
    if args.dry_run:
        # The command line is this mode's output, for scripts and job files: plain stdout, not the log.
        if args.lighthouse:  # an ft job's node 0 also serves the lighthouse (a comment line: scripts skip it)
            sys.stdout.write(
                f"# torchft lighthouse, served by this loom launch: {shlex.join(args.lighthouse)}\n"
            )
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        return 0
    with _lighthouse(args.lighthouse):
        if args.node is not None and args.node.nnodes > 1:
            _gate(args.node, args.rdzv_timeout, rejoin=args.max_restarts > 0)
        return _run(cmd, line)


@contextlib.contextmanager
def _lighthouse(cmd: list[str] | None):
    """An ft job's lighthouse (torchft's binary), served while the block runs (node 0 only)."""
    if not cmd:
        yield
        return
    log.info(f"loom launch: torchft lighthouse: {shlex.join(cmd)}")
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
    except FileNotFoundError:
        raise LoomError(f"{cmd[0]} not found", hint="pip install 'loom[ft]' (torchft 0.2)") from None
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run(cmd: list[str], line: str) -> int:
    log.info(f"loom launch: {line}")
    try:
        result = subprocess.run(cmd, check=False)
    except FileNotFoundError:
        raise LoomError(
            f"{cmd[0]} not found on PATH",
            hint="load the module that provides it, or choose another --launcher",
        ) from None
    except KeyboardInterrupt:
        return 130
    # A child killed by signal N reports -N; shells report 128 + N.
    return result.returncode if result.returncode >= 0 else 128 - result.returncode
