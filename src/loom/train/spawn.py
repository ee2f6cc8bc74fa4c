"""`loom train --nproc N`: N local processes through torch's elastic launcher, rendezvous on loopback.

The parent does the cheap checks once (config, world size against the batch, run directory, data
preparation), so a mistake gives one message instead of N, and the children agree on the run name.
If a worker dies, the elastic agent stops the others and the parent names the failed rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import uuid

from loom import log
from loom.config import ParallelDims, validate
from loom.errors import LoomError
from loom.train import RunRequest, layout_config, plan_run


def launch_local(nproc: int, req: RunRequest, child_argv: list[str], max_restarts: int = 0) -> int:
    """Check once here, then run `python -m loom train <child_argv>` in nproc processes. Returns an exit code.

    With max_restarts > 0 the elastic agent restarts all processes after a failure; restarted workers see
    TORCHELASTIC_RESTART_COUNT > 0 and continue from the newest valid checkpoint of the run. SIGTERM/SIGINT
    to this process reach the workers, which finish their step, save and exit with EXIT_PREEMPTED.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from loom import checkpoint
    from loom.distributed import loopback
    from loom.errors import EXIT_PREEMPTED

    cfg = req.cfg
    plan = plan_run(req, _local_dims(req, nproc), hashes=False)  # raises before any process starts;
    # the workers hash the checkpoint's files, each its share
    args = [a for a in child_argv if a != "--force"]
    if not req.resume:
        args.append(f"--run.name={plan.run_dir.name}")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"loom-{uuid.uuid4().hex[:8]}",
        rdzv_backend=loopback.register(),  # the store listens on 127.0.0.1 only
        rdzv_endpoint=f"{loopback.HOST}:0",
        rdzv_configs={"timeout": int(cfg.parallel.timeout_s)},
        max_restarts=max_restarts,
        monitor_interval=0.2,
        **_shutdown_option(LaunchConfig, cfg.parallel.timeout_s),
    )
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    restarts = f", up to {max_restarts} restart(s)" if max_restarts else ""
    log.info(f"starting {nproc} processes (rendezvous on {loopback.HOST}{restarts}) for run {plan.run_dir}")
    try:
        elastic_launch(config, sys.executable)("-m", "loom", "train", *args)
    except SignalException as e:
        newest = checkpoint.latest_valid(plan.run_dir / "ckpt")
        log.error(
            f"loom: {e.sigval.name}: the processes were asked to save and stop; "
            + (f"newest checkpoint {newest}" if newest else "no checkpoint was saved")
        )
        return EXIT_PREEMPTED
    except ChildFailedError as e:
        return _report_failure(e)
    return 0


def _shutdown_option(launch_config, timeout_s: float) -> dict:
    """After SIGTERM the workers finish their step and save; a stuck one is killed after this timeout. The
    option exists from torch 2.12 on (a feature check, not a version string); older launchers wait a fixed
    30 s (PContext.close's default)."""
    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(launch_config)}:
        return {}
    return {"shutdown_timeout": int(max(10, timeout_s))}


def _local_dims(req: RunRequest, nproc: int) -> ParallelDims:
    """The layout of `nproc` local processes (rank 0's), after every rule of config.validate() on the config whose
    layout they run (the saved one when resuming), before any process starts."""
    if nproc < 1:
        raise LoomError(f"--nproc must be >= 1, got {nproc}")
    layout = layout_config(req)
    if layout.parallel.dp_impl == "mpi" and nproc > 1:  # each child would be its own 1-process MPI world
        raise LoomError(
            f"--nproc {nproc} with parallel.dp_impl=mpi would start {nproc} separate 1-process trainings "
            "into the same run: MPI processes are started by mpiexec, not by --nproc",
            hint=f"mpiexec -n {nproc} loom train ... (without --nproc), or "
            f"loom launch --launcher mpiexec --nproc-per-node {nproc} -- loom train ...",
        )
    return validate(layout, nproc)[1]


def _report_failure(e) -> int:
    """The exit code of a job whose workers failed (torch's ChildFailedError), and one line naming the rank
    that failed first: a rank killed by a signal is the cause when the others only saw it die."""
    from loom.errors import EXIT_PREEMPTED

    if all(f.exitcode == EXIT_PREEMPTED for f in e.failures.values()):
        log.error(f"loom: stopped by a signal after saving a checkpoint (exit code {EXIT_PREEMPTED})")
        return EXIT_PREEMPTED
    first_rank, first = e.get_first_failure()
    # a rank killed by a signal, SIGTERM last: the launcher stops the surviving ranks with SIGTERM, and under
    # load one of them can be recorded before the rank whose death started it all (seen: 4 ranks, 2 cores)
    killed = sorted(
        (f.signal_name() == "SIGTERM", f.timestamp, r) for r, f in e.failures.items() if f.exitcode < 0
    )
    if killed and (first.exitcode >= 0 or first.signal_name() == "SIGTERM"):
        first_rank = killed[0][2]
        first = e.failures[first_rank]

    def how(f) -> str:
        return f.signal_name() if f.exitcode < 0 else f"exit code {f.exitcode}"

    others = [f"rank {r} ({how(f)})" for r, f in sorted(e.failures.items()) if r != first_rank]
    log.error(
        f"loom: error: rank {first_rank} (pid {first.pid}) failed first: {how(first)}; the other ranks were "
        "stopped" + (f" ({', '.join(others)} after it)" if others else "")
    )
    return 1
