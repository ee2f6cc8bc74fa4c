"""Weights from a trainer rank to its rollout worker (rl.max_staleness > 0), over a process group of their own.

The channel: a gloo process group of two members (the trainer rank, 0, and its worker, 1) made on a TCPStore of
its own on 127.0.0.1 (a free port), as a ProcessGroupGloo object that is nobody's default group. Why this and
not the training job's group, a pipe or shared memory:
  - its own group: the pushes never queue behind (or between) the training's all-reduces, and a worker that dies
    cannot break the training job's group (one trainer process here: validate refuses rl.max_staleness
    with several data-parallel ranks);
  - a process group rather than a pipe: the same send/recv a sampler on another device or host would take (over
    NCCL between a trainer GPU and a sampler GPU, as verl, prime-rl and TRL's vLLM weight updates do), and no
    pickling of weights; shared memory would be faster on one host but only on one host.
A push is a header (the version: the optimizer steps the weights have taken) then one flat tensor per dtype of
the model's state, in the order of `layout()`; the trainer does not wait for it (gloo's send returns a Work that
completes once the worker has taken it), and a copy is sent, so training may change the weights at once.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from loom.errors import LoomError

_TAG = 7  # the pushes' tag on the pair's group (the only traffic on it)


def live_state(model: torch.nn.Module, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """{single-device name: the live tensor} of a model's state (parameters and persistent buffers), wrappers'
    prefixes removed and a tied tensor once (under its canonical name)."""
    from loom.parallel.init import canonical

    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        name = canonical(k, aliases)
        if name not in out:
            out[name] = v
    return out


def layout(state: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor a push carries, in its order: grouped by dtype, names sorted."""
    rows = [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()]
    return sorted(rows, key=lambda r: (r[2], r[0]))


def _groups(rows) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    out: dict[str, list] = {}
    for name, shape, dtype in rows:
        out.setdefault(dtype, []).append((name, shape))
    return list(out.items())


def pair_store(port: int, host: bool, timeout_s: float) -> dist.TCPStore:
    """The pair's TCPStore on 127.0.0.1 (the trainer hosts it on `port`, 0: a free one; `store.port` says which)."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        2,
        host,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def pair_group(store: dist.TCPStore, rank: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """The two members' gloo group on the store (blocks until both have joined)."""
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))


class WeightSender:
    """The trainer's end: push(version) sends a copy of the weights now, kept until the worker has it."""

    def __init__(self, group, state: dict[str, torch.Tensor]):
        self.group, self.state = group, state
        self.rows = layout(state)
        self.inflight: list[tuple[int, list, list[torch.Tensor]]] = []  # (version, works, what they send)
        self.pushed = -1  # the newest version pushed

    @torch.no_grad()
    def push(self, version: int) -> None:
        header = torch.tensor([version], dtype=torch.int64)
        flats = [
            torch.cat([self.state[n].detach().reshape(-1) for n, _ in names]).to("cpu")
            for _, names in _groups(self.rows)
        ]
        works = [self.group.send([t], 1, _TAG) for t in (header, *flats)]
        self.inflight.append((version, works, [header, *flats]))
        self.pushed = version

    def taken(self, version: int) -> None:
        """The worker has received every push up to `version` (it sampled with it): their copies are freed.
        (A gloo send's Work is not marked complete until waited on, so the worker's word is what tells.)"""
        keep = []
        for v, works, tensors in self.inflight:
            if v <= version:
                for w in works:
                    w.wait()  # done already: returns at once (or raises what failed)
            else:
                keep.append((v, works, tensors))
        self.inflight = keep


class WeightReceiver:
    """The worker's end: receive() takes the next push into the worker model's tensors; returns its version."""

    def __init__(self, group, state: dict[str, torch.Tensor], rows: list):
        mine = layout(state)
        if [tuple(r) for r in rows] != mine:
            theirs = {r[0]: r[1:] for r in rows}
            diff = [n for n, *rest in mine if theirs.get(n) != tuple(rest)][:3]
            raise LoomError(
                f"the rollout worker's model is not the trainer's: {len(rows)} tensors pushed, {len(mine)} "
                f"here; first differences: {diff or sorted(set(theirs) - {r[0] for r in mine})[:3]}",
                hint="a bug: the worker builds its model from the run's config as the trainer does",
            )
        self.group, self.state, self.rows = group, state, mine
        self.version = -1

    @torch.no_grad()
    def receive(self) -> int:
        header = torch.zeros(1, dtype=torch.int64)
        self.group.recv([header], 0, _TAG).wait()
        for dtype, names in _groups(self.rows):
            flat = torch.empty(sum(_numel(s) for _, s in names), dtype=getattr(torch, dtype))
            self.group.recv([flat], 0, _TAG).wait()
            at = 0
            for name, shape in names:
                n = _numel(shape)
                dst = self.state[name]
                dst.detach().copy_(flat[at : at + n].view(shape))
                at += n
        self.version = int(header.item())
        return self.version


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
