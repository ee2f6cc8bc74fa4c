"""Data parallelism with torch's DistributedDataParallel, and how its gradient all-reduce is sent.

DDP wraps the single-device model; gradients are all-reduced (averaged) in buckets during backward, and
with gradient accumulation only the last micro-step communicates, through DDP's public `no_sync()`. DDP
broadcasts rank 0's parameters and buffers at construction, so every rank starts equal.

Slow links (parallel.grad_compression): PyTorch's DDP communication hooks replace the bucket's all-reduce.
bf16/fp16 cast each bucket to half precision before the all-reduce and back after (half the bytes, the
rounding of one cast per step). PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient
Compression") sends each gradient matrix M (n x m) as P (n x r) and Q (m x r) with one power iteration per
step and error feedback (what the approximation missed is added to the next step's gradient); vectors and
matrices too small to gain go at full precision; the first `powersgd_warmup` steps are plain all-reduces.
`SyncBytes` counts what each step hands the all-reduce (per rank; a ring all-reduce puts 2(n-1)/n of it
on each rank's link).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from loom import compat


def apply_ddp(
    model: nn.Module, device: torch.device, ignore: list[str] = (), process_group=None
) -> DistributedDataParallel:
    """ignore: parameter names DDP leaves alone (expert weights under expert parallelism: each rank holds
    different ones, synchronised by loom.parallel.expert); process_group: the ranks it averages over (None:
    the job; a DiLoCo replica's ranks: loom.parallel.diloco)."""
    ids = [device.index] if device.type == "cuda" else None
    if ignore:
        compat.ddp_ignore(model, list(ignore))
    return DistributedDataParallel(model, device_ids=ids, process_group=process_group)


class SyncBytes:
    """Bytes this rank handed the gradient all-reduce since the last `take()` (one step's): counted by a hook,
    or `fixed` (DDP's own all-reduce: every trained gradient once a step, at its dtype)."""

    def __init__(self, fixed: int | None = None):
        self.n, self.fixed = 0, fixed

    def take(self) -> int:
        n, self.n = self.n, 0
        return self.fixed if self.fixed is not None else n


def _powersgd_bytes(state, grads: list[torch.Tensor]) -> int:
    """What torch's powerSGD_hook all-reduces for these gradients now: everything during the warm-up, then
    P and Q of each matrix worth compressing and the rest whole (its rule: (n + m) r x min_rate < n m)."""
    if state.iter < state.start_powerSGD_iter:
        return sum(g.numel() * g.element_size() for g in grads)
    total = 0
    for g in grads:
        if g.ndim > 1:
            n, m = g.shape[0], g.numel() // g.shape[0]
            r = min(n, m, state.matrix_approximation_rank)
            if (n + m) * r * state.min_compression_rate < n * m:
                total += (n + m) * r * g.element_size()
                continue
        total += g.numel() * g.element_size()
    return total


def apply_compression(ddp: DistributedDataParallel, kind: str, rank: int, warmup: int) -> SyncBytes:
    """Register the communication hook of `kind` (none | bf16 | fp16 | powersgd) on `ddp`; returns the byte
    counter. `none` keeps DDP's built-in all-reduce (no Python hook: its numbers stay bit for bit) and counts
    the buckets' bytes after backward instead."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if kind == "none":
        return SyncBytes(sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad))
    counter, group = SyncBytes(), ddp.process_group
    if kind == "powersgd":
        state = psgd.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=warmup)
        hook = psgd.powerSGD_hook

        def count(bucket) -> int:
            return _powersgd_bytes(state, bucket.gradients())
    else:
        state, hook = group, (default.bf16_compress_hook if kind == "bf16" else default.fp16_compress_hook)

        def count(bucket) -> int:
            return bucket.buffer().numel() * 2

    def counted(state_, bucket):
        counter.n += count(bucket)
        fut = hook(state_, bucket)
        if kind == "powersgd":
            # PowerSGD issues a bucket's Q all-reduce from the callback of its P all-reduce, on gloo's thread,
            # while backward goes on issuing the next bucket's from its own: the order differs between ranks,
            # and gloo, which pairs collectives by the order they are issued, hangs or breaks (2 ranks, 2
            # buckets: at the first compressed step). Waiting here issues every rank's in the same order.
            fut.wait()
        return fut

    ddp.register_comm_hook(state, counted)
    return counter
