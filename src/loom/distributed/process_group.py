"""Process-group lifecycle: a backend per device type; a timeout from config; a barrier before destroy.

A GPU job's group is `cpu:gloo,cuda:nccl`: NCCL carries the CUDA tensors (gradients, parameters, activations)
and gloo the small CPU tensors of the control plane (`loom.distributed.comm`: config agreement, stop and
non-finite flags, the checkpoint outcome). An NCCL-only group has no backend for a CPU tensor, so every
control-plane collective of a multi-GPU job would fail before its first step.

On this machine 4-process gloo runs abort at exit ("terminate called without an active exception") unless
every rank passes a barrier before `destroy_process_group()`, so `shutdown()` always does that.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from loom import device as dev
from loom import log
from loom.env import DistEnv
from loom.errors import LoomError


def backend_for(device: torch.device) -> str:
    """The backend string for a job on `device`: one backend per device type the job's tensors live on."""
    return dev.dist_backend(device)


def init(env: DistEnv, device: torch.device, timeout_s: float) -> None:
    """Join the job's process group (env:// rendezvous at MASTER_ADDR:MASTER_PORT)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dev.set_device(device)
    if device.type == "cuda":
        from loom.distributed.health import nccl_env

        for k, v in nccl_env().items():  # watchdog, async error handling, flight recorder: before init
            os.environ.setdefault(k, v)
    backend = backend_for(device)
    try:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type in dev.DIST_BACKEND else None,
        )
    except (RuntimeError, ValueError) as e:
        raise LoomError(
            f"could not join the process group at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
            f"as rank {env.rank}/{env.world_size}: {e}",
            hint="check that MASTER_ADDR is reachable from every node and MASTER_PORT is free",
        ) from None
    log.info(
        f"process group: {backend}, world {env.world_size}, launcher {env.launched_by}, timeout {timeout_s:.0f}s"
    )


def shutdown(clean: bool = True, destroy_timeout_s: float = 30.0) -> None:
    """Barrier (when the run ended normally) then destroy; safe to call when not initialised.

    destroy_process_group() has been seen to hang on rank 0 of a 4-process gloo job after every other rank
    had destroyed and exited; it runs in a daemon thread so a hang costs at most destroy_timeout_s.
    """
    import threading

    if not dist.is_initialized():
        return
    try:
        if clean:
            dist.barrier()
    finally:
        t = threading.Thread(target=dist.destroy_process_group, daemon=True)
        t.start()
        t.join(destroy_timeout_s)
        if t.is_alive():
            log.warn(f"destroy_process_group did not return within {destroy_timeout_s:.0f}s; leaving it")
