"""What several verbs share: options refused beside others, the --shard help, a run's model opened on the
device a command names, and leaving a job of several processes."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from loom.errors import LoomError

SHARD_HELP = (
    "in a job of several processes (torchrun, srun, mpiexec): split the model over them with FSDP, "
    "each reading only its part of the checkpoint (for a model that does not fit one device)"
)


def refuse_options(parser, argv: list[str], dests: tuple[str, ...], why: str, remedy: str = "") -> None:
    """Refuse the options among `dests` that argv gives (even at their default value: argparse sets a default
    only on a namespace that lacks the attribute, so a pre-filled one tells what the command line set)."""
    unset = object()
    ns = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    given = ["--" + d.replace("_", "-") for d in dests if getattr(ns, d) is not unset]
    if given:
        are = "is an option" if len(given) == 1 else "are options"
        raise LoomError(f"{', '.join(given)} {are} {why}", hint=f"leave out {', '.join(given)}{remedy}")


def leave_job(code: int) -> None:
    """End a rank of a multi-process job. Every file is closed and the process group destroyed after a
    barrier; still, gloo jobs here sometimes abort in C++ static destructors at interpreter exit ("terminate
    called without an active exception"), which would turn a finished job into a failed one. Leave without
    them."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:  # mpiexec treats a rank that skips MPI_Finalize as failed
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(code)


def device_of(args, env):
    """The device --device names (auto: this rank's GPU, else mps, else the CPU)."""
    from loom.train.setup import resolve_device

    return resolve_device(args.device, env.local_rank, key="--device")


@contextlib.contextmanager
def run_model(args, split: bool = False):
    """args.run_dir's model (loom.runs.open_run) on --device, whole or with --shard sharded over the job;
    `split`: in a job without --shard the ranks each hold the whole model and share the work. A job of several
    processes is left when the block ends (the command has printed its result)."""
    from loom.env import detect_env
    from loom.runs import open_run

    env = detect_env()
    ckpt, shard = getattr(args, "ckpt", None), getattr(args, "shard", False)
    with open_run(args.run_dir, device_of(args, env), env, ckpt=ckpt, shard=shard, split=split) as run:
        yield run
    if run.world > 1:
        leave_job(0)
