"""DDP's bucket waits (loom.distributed.stragglers.BucketWaits, registered by loom.parallel.ddp) on 2 real gloo
ranks: the timed hook leaves the gradients what DDP's built-in all-reduce makes of them, bit for bit, and the
rank that starts its backward late is the one that waits least, the other waiting at least as long as it was
late. Compared against DDP without a hook, and against the delay the test puts in."""

from __future__ import annotations

import time

from gloo_ranks import spawn_gloo

LATE_S = 1.0


def _grads(rank: int, timed: bool, late: bool):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from loom.distributed.stragglers import BucketWaits
    from loom.parallel.ddp import apply_compression

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    ddp = DistributedDataParallel(model)
    waits = BucketWaits(torch.device("cpu")) if timed else None
    apply_compression(ddp, "none", 0, 0, waits)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    for step in range(2):  # the first rebuilds DDP's buckets
        ddp.zero_grad()
        loss = ddp(x).square().mean()
        dist.barrier()
        if late and step == 1:
            time.sleep(LATE_S)
        if waits is not None:
            waits.take()  # the step before's
        loss.backward()
    exposed = waits.take() if timed else None
    return [p.grad.clone() for p in model.parameters()], exposed


def _compare(rank: int, world: int) -> None:
    import torch

    plain, _ = _grads(rank, timed=False, late=False)
    timed, exposed = _grads(rank, timed=True, late=rank == 1)
    assert all(torch.equal(a, b) for a, b in zip(plain, timed, strict=True))
    assert exposed is not None and exposed.spans and exposed.done()
    waits = [None, None]
    torch.distributed.all_gather_object(waits, exposed.seconds())
    # rank 0 could not finish before rank 1 started its backward, LATE_S after the barrier
    assert waits[0] >= 0.5 * LATE_S and waits[1] < waits[0], waits


def test_timed_buckets_keep_the_gradients_and_show_who_waited(tmp_path):
    spawn_gloo(_compare, 2, tmp_path)
