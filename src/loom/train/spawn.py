"""`loom train --nproc N`: N local processes through torch's elastic launcher, rendezvous on loopback.

The parent does the cheap checks once (config, world size against the batch, run directory, data
preparation), so a mistake gives one message instead of N, and the children agree on the run name.
If a worker dies, the elastic agent stops the others and the parent names the failed rank.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from loom import log
from loom.config import Config
from loom.env import free_port
from loom.errors import LoomError


def launch_local(
    nproc: int, cfg: Config, child_argv: list[str], resume, force: bool, explicit: set[str]
) -> int:
    """Check once here, then run `python -m loom train <child_argv>` in nproc processes. Returns an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from loom.train import plan_run

    if nproc < 1:
        raise LoomError(f"--nproc must be >= 1, got {nproc}")
    if cfg.parallel.dp_impl == "none":
        raise LoomError("--nproc > 1 with parallel.dp_impl=none", hint="use parallel.dp_impl=ddp (or auto)")
    plan = plan_run(cfg, resume, force, explicit, nproc)  # raises before any process starts
    args = [a for a in child_argv if a != "--force"]
    if not resume:
        args.append(f"--run.name={plan.run_dir.name}")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    port = free_port()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"loom-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"timeout": int(cfg.parallel.timeout_s)},
        max_restarts=0,
        monitor_interval=0.2,
    )
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    log.info(f"starting {nproc} processes (rendezvous 127.0.0.1:{port}) for run {plan.run_dir}")
    try:
        elastic_launch(config, sys.executable)("-m", "loom", "train", *args)
    except ChildFailedError as e:
        first_rank, first = e.get_first_failure()

        def how(f) -> str:
            return f.signal_name() if f.exitcode < 0 else f"exit code {f.exitcode}"

        others = [f"rank {r} ({how(f)})" for r, f in sorted(e.failures.items()) if r != first_rank]
        log.error(
            f"loom: error: rank {first_rank} (pid {first.pid}) failed first: {how(first)}; the other ranks were "
            "stopped" + (f" ({', '.join(others)} after it)" if others else "")
        )
        return 1
    return 0
