"""FSDP's and the pipeline's waits for peers (loom.distributed.stragglers.BlockedWaits, installed by
loom.parallel.parallelize when the straggler monitor is on) on 2 real gloo ranks: the timed all-gathers,
reduce-scatters, HSDP's all-reduces across replicas and P2P waits leave every gradient what the untimed layout
makes of it, bit for bit, and the rank that starts its step late is the one that waits least, the other
waiting at least half as long as it was late, out of its forward/backward and into `wait`; the same for the
step's own collectives (the pipeline's tied pair, the gradient norm: Parallel.blocked). Compared against the
same layout with the monitor off, and against the delay the test puts in."""

from __future__ import annotations

import time

import pytest
from gloo_ranks import parallelized, spawn_gloo

SEED, VOCAB, LATE_S = 1234, 70, 1.0


def _cfg(parallel: dict, every: int):
    from loom.config import Config

    cfg = Config()
    m = cfg.model
    m.n_layer, m.n_head, m.n_embd, m.block_size = 2, 2, 32, 16
    cfg.train.batch_size, cfg.run.seed, cfg.train.straggler_every = 8, SEED, every
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _step(par, clock, x, y, late: bool) -> None:
    import contextlib

    with clock("forward"):
        if late:
            time.sleep(LATE_S)
        if par.pipeline is not None:  # the schedule runs forward and backward (the trainer's forward phase)
            par.pipeline.step(x, y, contextlib.nullcontext)
            return
        loss = par.forward(x, y)
    with clock("backward"):
        loss.backward()


def _grads(par) -> list:
    return [
        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
        for p in par.model.parameters()
        if p.grad is not None
    ]


def _compare(rank: int, world: int, parallel: dict) -> None:
    import torch
    import torch.distributed as dist

    from loom.distributed.stragglers import BlockedWaits, PhaseClock

    x = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(rank))
    y = torch.roll(x, -1, 1)
    grads, seen = [], []
    for every in (0, 4):  # the monitor off, then on
        _, par = parallelized(_cfg(parallel, every), world, rank, VOCAB, SEED)
        assert (par.bucket_waits is not None) == bool(every)
        clock = PhaseClock(torch.device("cpu"), enabled=bool(every), waits=par.bucket_waits)
        for step in range(2):  # the first: lazy set-ups on every rank alike
            for p in par.model.parameters():
                p.grad = None
            dist.barrier()
            clock.take()
            _step(par, clock, x, y, late=bool(every) and step == 1 and rank == 1)
        grads.append(_grads(par))
        seen.append(clock.take())
    assert isinstance(par.bucket_waits, BlockedWaits)
    assert grads[0] and len(grads[0]) == len(grads[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    phases = [None] * world
    dist.all_gather_object(phases, seen[1])
    waits = [p["wait"] for p in phases]
    # rank 0 waited for rank 1 in the collectives (not in its own forward/backward); rank 1 hardly at all
    assert waits[0] >= 0.5 * LATE_S and waits[1] < waits[0], phases
    assert phases[0]["forward"] + phases[0]["backward"] < phases[1]["forward"] + phases[1]["backward"], phases


@pytest.mark.parametrize(
    "parallel",
    [
        {"dp_impl": "fsdp"},
        {"dp_impl": "zero2"},
        {"pp": 2, "pp_microbatches": 2},
        {"dp_impl": "fsdp", "dp_replicate": 2},  # HSDP 2 x 1: the wait is in the all-reduce across replicas
    ],
    ids=["fsdp", "zero2", "pp", "hsdp"],
)
def test_timed_collectives_keep_the_gradients_and_show_who_waited(tmp_path, parallel):
    spawn_gloo(_compare, 2, tmp_path, parallel)


def _after_backward(rank: int, world: int, parallel: dict, phase: str) -> None:
    import torch
    import torch.distributed as dist

    from loom.distributed.stragglers import PhaseClock

    x = torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(rank))
    y = torch.roll(x, -1, 1)
    _, par = parallelized(_cfg(parallel, 4), world, rank, VOCAB, SEED)
    if phase == "comm":  # GPT-2's embedding and head: on the first and the last stage
        assert par.tied_group is not None
    clock = PhaseClock(torch.device("cpu"), waits=par.bucket_waits)
    for step in range(2):
        dist.barrier()
        clock.take()
        _step(par, clock, x, y, late=False)
        with clock(phase):  # the trainer's phases of the two collectives
            if step == 1 and rank == 1:
                time.sleep(LATE_S)
            if phase == "comm":
                par.sync_grads()
            else:
                par.clip_grad_norm(1.0)
    phases = [None] * world
    dist.all_gather_object(phases, clock.take())
    # rank 0 waited for rank 1 in the collective: its `wait`, not its own `comm` or `optimizer`; rank 1's
    # lateness is its own phase's time
    assert phases[0]["wait"] >= 0.5 * LATE_S and phases[0][phase] < 0.5 * LATE_S, phases
    assert phases[1][phase] >= LATE_S and phases[1]["wait"] < phases[0]["wait"], phases


@pytest.mark.parametrize(
    "parallel, phase",
    [
        ({"pp": 2, "pp_microbatches": 2}, "comm"),
        ({"pp": 2, "pp_microbatches": 2}, "optimizer"),
        ({"dp_impl": "fsdp"}, "optimizer"),
    ],
    ids=["pp-tied-pair", "pp-grad-norm", "fsdp-grad-norm"],
)
def test_a_rank_waiting_in_the_steps_own_collectives_is_a_wait(tmp_path, parallel, phase):
    """The pipeline's tied embedding/head all-reduce (the step's `comm`) and the gradient norm's (in the
    `optimizer`; FSDP's inside torch's clip_grad_norm_): a rank late there holds the other in the collective,
    and the other's time there is its `wait` (Parallel.blocked)."""
    spawn_gloo(_after_backward, 2, tmp_path, parallel, phase)
