"""Real gloo processes for the tests that call loom's parallel code directly instead of through `loom` (a
module beside conftest.py, on the tests' path).

`spawn_gloo(fn, world, tmp_path, *args)` starts `world` processes; each joins one gloo group (a file store in
tmp_path), runs `fn(rank, world, *args)`, passes a barrier, destroys the group and leaves with `os._exit(0)`.
A rank that returns normally instead has been seen to abort in the interpreter's teardown, after its atexit
handlers ("terminate called without an active exception", SIGABRT, about 1 run in 5 of a 2-rank Ulysses
test on 2 cores, torch 2.11 and 2.13): the test then fails although every rank finished its work. loom's
own ranks leave the same way (`loom.cli`). A rank whose `fn` raises leaves normally, so torch's spawn reports
that exception.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_gloo(fn: Callable[..., None], world: int, tmp_path: Path, *args) -> None:
    """Run `fn(rank, world, *args)` on `world` gloo ranks (fn: a module-level function, for pickling)."""
    mp.spawn(_rank, args=(fn, world, str(tmp_path / "store"), args), nprocs=world, join=True)


def _rank(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
