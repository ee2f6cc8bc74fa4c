"""Real gloo processes for the tests that call loom's parallel code directly instead of through `loom` (a
module beside conftest.py, on the tests' path).

`parallelized(cfg, world, rank, vocab, seed)` is a rank's model laid out as the trainer lays it out.
`spawn_gloo(fn, world, tmp_path, *args)` starts `world` processes (forks of a server that imported torch once,
with this process's environment, folder and path); each joins one gloo group (a file store in
tmp_path), runs `fn(rank, world, *args)`, passes a barrier, destroys the group and leaves with `os._exit(0)`.
A rank that returns normally instead has been seen to abort in the interpreter's teardown, after its atexit
handlers ("terminate called without an active exception", SIGABRT, about 1 run in 5 of a 2-rank Ulysses
test on 2 cores, torch 2.11 and 2.13): the test then fails although every rank finished its work. loom's
own ranks leave the same way (`loom.cli`). A rank whose `fn` raises leaves normally, so torch's spawn reports
that exception.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

# PRELOAD: what every rank imports, imported once by multiprocessing's fork server: each rank is then a fork
# of it, without an interpreter start and torch's and dynamo's imports of its own (~4 s of CPU a rank). The
# server has only imported, never run an op (no OpenMP or other threads to lose in a fork); it lives as long as
# this process (conftest's session end stops it). `loom train --nproc` run in this process (loomrun.loom_here,
# verify) forks its workers from the same server, hence loom's list.
from loom.train.spawn import PRELOAD


def spawn_gloo(fn: Callable[..., None], world: int, tmp_path: Path, *args) -> None:
    """Run `fn(rank, world, *args)` on `world` gloo ranks (fn: a module-level function, for pickling)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    # this process's environment, folder and path now, not the server's when it started
    state = (dict(os.environ), os.getcwd(), list(sys.path))
    mp.start_processes(
        _rank,
        args=(fn, world, str(tmp_path / "store"), args, state),
        nprocs=world,
        join=True,
        start_method="forkserver",
    )


def parallelized(cfg, world: int, rank: int, vocab: int, seed: int):
    """(the model, loom.parallel.Parallelized) of `cfg` on this rank: built on the meta device, each rank then
    materializing and initialising only its pieces (seeded by name, as the trainer does)."""
    import torch

    from loom.config import validate
    from loom.model.registry import spec_of
    from loom.parallel import parallelize
    from loom.train.trainer import build_model

    derived, dims = validate(cfg, world, rank)
    model = build_model(cfg, vocab)  # meta
    assert all(p.is_meta for p in model.parameters())
    par = parallelize(
        model,
        dims,
        cfg,
        torch.device("cpu"),
        spec_of(cfg),
        n_microbatches=derived.pp_microbatches,
        init=lambda name, whole: model.init_param(name, whole, seed),
    )
    return model, par


def _rank(rank: int, fn: Callable[..., None], world: int, store: str, args: tuple, state: tuple) -> None:
    env, cwd, path = state
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    fn(rank, world, *args)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
