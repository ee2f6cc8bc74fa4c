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

import math
import re

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from loom import compat, log
from loom.distributed.stragglers import BucketWaits
from loom.errors import LoomError, PeerError


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
    or `fixed` (DDP's own all-reduce: every trained gradient once a step, at its dtype). `hook_state`: what a
    checkpoint must keep of the hook (PowerSGD's: PowerSGDCheckpoint), else None."""

    def __init__(self, fixed: int | None = None):
        self.n, self.fixed = 0, fixed
        self.hook_state = None

    def take(self) -> int:
        if self.hook_state is not None:
            self.hook_state.step_done()
        n, self.n = self.n, 0
        return self.fixed if self.fixed is not None else n


def _low_rank(state, shape: torch.Size) -> int:
    """The rank torch's powerSGD_hook gives a gradient of this shape, 0 when it sends it whole (its
    _should_compress: (n + m) r x min_rate < n m)."""
    n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
    r = min(n, m, state.matrix_approximation_rank)
    return r if (n + m) * r * state.min_compression_rate < n * m else 0


def _pq_slices(state, shapes: list[torch.Size]) -> list[tuple[int, int, int, int]]:
    """(p offset, p length, q offset, q length) of each gradient in its bucket's P and Q memory ((0, 0, 0, 0)
    for one sent whole), in torch's order: the compressed matrices grouped by shape, shapes in order of first
    appearance, each group in bucket order."""
    out = [(0, 0, 0, 0)] * len(shapes)
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(shapes):
        if _low_rank(state, shape):
            groups.setdefault((shape[0], math.prod(shape[1:])), []).append(i)
    p = q = 0
    for (n, m), members in groups.items():
        for i in members:
            r = _low_rank(state, shapes[i])
            out[i] = (p, n * r, q, m * r)
            p, q = p + n * r, q + m * r
    return out


class PowerSGDCheckpoint:
    """PowerSGD's state in a checkpoint, so that a resumed run continues its compression exactly instead of
    starting its warm-up again: the iteration, the error feedback (this rank's own), the warm-started P and Q
    and the random state. torch keeps them per DDP bucket, and DDP rebuilds its buckets after a run's first
    step (another order: in a run from the start that is still the warm-up, after a resume it is not), so
    they are kept per parameter across a checkpoint or a rebuild and put back into each bucket when the hook
    first sees it. Keys: `powersgd.rank<r>.<what>[.<parameter>]`, one rank's each (error feedback differs)."""

    def __init__(self, state, model: nn.Module, rank: int):
        self.state, self.rank = state, rank
        self.names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.seen: dict[int, list[str]] = {}  # bucket index -> its parameters' names, in bucket order
        self.pending: dict[str, torch.Tensor] | None = None  # per parameter, not yet put back into buckets

    def _key(self, what: str) -> str:
        return f"powersgd.rank{self.rank}.{what}"

    def before_hook(self, bucket) -> None:
        """Called with each bucket before the hook: a changed bucket (DDP's rebuild) moves the state to
        per-parameter pieces; a bucket without state takes its pieces back."""
        st, idx = self.state, bucket.index()
        names = [self.names[id(p)] for p in bucket.parameters()]
        if self.seen.get(idx, names) != names and self.pending is None:
            self.pending = self._per_parameter()
            st.error_dict.clear(), st.p_memory_dict.clear(), st.q_memory_dict.clear()
            self.seen = {}
        self.seen[idx] = names
        if self.pending is not None and idx not in st.error_dict:
            self._restore(idx, names)

    def step_done(self) -> None:
        """After a step every bucket has been seen: what was pending is in place."""
        self.pending = None

    def _slices(self, names: list[str]) -> tuple[list[int], list[tuple[int, int, int, int]]]:
        """Each parameter's offset in its bucket (and the end), and its P and Q slices."""
        offsets = [0]
        for n in names:
            offsets.append(offsets[-1] + self.params[n].numel())
        return offsets, _pq_slices(self.state, [self.params[n].shape for n in names])

    def _per_parameter(self) -> dict[str, torch.Tensor]:
        st, out = self.state, {}
        for idx, names in self.seen.items():
            if idx not in st.error_dict:
                continue
            offsets, slices = self._slices(names)
            for i, name in enumerate(names):
                out[self._key(f"error.{name}")] = st.error_dict[idx][offsets[i] : offsets[i + 1]]
                p0, pn, q0, qn = slices[i]
                if pn and idx in st.p_memory_dict:
                    out[self._key(f"p.{name}")] = st.p_memory_dict[idx][p0 : p0 + pn]
                    out[self._key(f"q.{name}")] = st.q_memory_dict[idx][q0 : q0 + qn]
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        st = self.state
        keys, pos, has_gauss, cached = st.rng.get_state()[1:]
        pieces = self.pending if self.pending is not None else self._per_parameter()
        return {
            self._key("iter"): torch.tensor([st.iter], dtype=torch.int64),
            self._key("rng"): torch.from_numpy(keys.astype("int64")),
            self._key("rng_pos"): torch.tensor([pos, has_gauss, cached], dtype=torch.float64),
            **{k: v.detach().clone() for k, v in pieces.items()},
        }

    def expected(self, saved) -> dict[str, torch.Tensor]:
        """Tensors to load this rank's keys into, of those `saved` holds; none on every rank unless every rank
        of this job has its own (a plain checkpoint, a larger world): half the ranks compressing and half
        warming up would pair different collectives."""
        world = torch.distributed.get_world_size()
        if any(f"powersgd.rank{r}.iter" not in saved for r in range(world)):
            return {}
        out = {
            self._key("iter"): torch.zeros(1, dtype=torch.int64),
            self._key("rng"): torch.zeros(624, dtype=torch.int64),
            self._key("rng_pos"): torch.zeros(3, dtype=torch.float64),
        }
        for name, p in self.params.items():
            r = _low_rank(self.state, p.shape)
            shapes = {"error": p.numel(), "p": p.shape[0] * r, "q": p.numel() // p.shape[0] * r}
            for what, n in shapes.items():
                if n and self._key(f"{what}.{name}") in saved:
                    out[self._key(f"{what}.{name}")] = torch.zeros(n, dtype=p.dtype, device=p.device)
        return out

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        import numpy as np

        st = self.state
        st.iter = int(sd[self._key("iter")][0])
        pos, has_gauss, cached = sd[self._key("rng_pos")].tolist()
        keys = sd[self._key("rng")].numpy().astype(np.uint32)
        st.rng.set_state(("MT19937", keys, int(pos), int(has_gauss), cached))
        st.error_dict.clear(), st.p_memory_dict.clear(), st.q_memory_dict.clear()
        self.seen = {}
        self.pending = {k: v for k, v in sd.items() if k.split(".")[2] in ("error", "p", "q")}

    def _restore(self, idx: int, names: list[str]) -> None:
        """Bucket `idx`'s error feedback, P and Q from the per-parameter pieces (torch makes them afresh, and
        draws new random Qs, for a bucket whose pieces are not there: a checkpoint of the warm-up)."""
        st, pending = self.state, self.pending
        if any(self._key(f"error.{n}") not in pending for n in names):
            return
        st.error_dict[idx] = torch.cat([pending[self._key(f"error.{n}")] for n in names])
        offsets, slices = self._slices(names)
        like = st.error_dict[idx]
        p = like.new_empty(sum(sl[1] for sl in slices))
        q = like.new_empty(sum(sl[3] for sl in slices))
        for n, (p0, pn, q0, qn) in zip(names, slices, strict=True):
            if pn:
                p[p0 : p0 + pn] = pending[self._key(f"p.{n}")]
                q[q0 : q0 + qn] = pending[self._key(f"q.{n}")]
        st.p_memory_dict[idx], st.q_memory_dict[idx] = p, q


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


def _folded(name: str) -> str:
    """A parameter's name with its layer numbers folded ('h.3.mlp.w' -> 'h.*.mlp.w') and torch.compile's prefix
    dropped: one name for the same matrix of every layer."""
    return re.sub(r"\.\d+\.", ".*.", name.replace("_orig_mod.", ""))


def uncompressed_matrices(state, model: nn.Module) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """({folded name: shape} of the trained matrices PowerSGD sends whole at this rank, the folded names of all
    of them): a rank at or near a matrix's width gains nothing on it (torch's rule, _low_rank), and torch then
    all-reduces it in full without a word."""
    whole: dict[str, tuple[int, ...]] = {}
    every: set[str] = set()
    for name, p in model.named_parameters():
        if p.requires_grad and p.ndim > 1:
            every.add(_folded(name))
            if not _low_rank(state, p.shape):
                whole.setdefault(_folded(name), tuple(p.shape))
    return whole, every


def check_powersgd_rank(state, model: nn.Module) -> None:
    """parallel.powersgd_rank at or above the matrices' widths: refused when PowerSGD would compress none of
    them (a full all-reduce every step, PowerSGD's work on top); else a warning naming those it sends whole."""
    whole, every = uncompressed_matrices(state, model)
    if not whole:
        return
    r = state.matrix_approximation_rank
    named = [f"{n} ({' x '.join(map(str, shape))})" for n, shape in whole.items()]
    listed = ", ".join(named[:6]) + (f" and {len(named) - 6} more" if len(named) > 6 else "")
    why = (
        f"a rank r gains nothing on an n x m matrix unless (n + m) x r x {state.min_compression_rate:g} < n x m, "
        "PyTorch's rule"
    )
    if set(whole) == every:
        # every rank finds the same; rank 0 says it, the others stop quietly
        error = LoomError if torch.distributed.get_rank() == 0 else PeerError
        raise error(
            f"parallel.powersgd_rank={r} compresses none of this model's matrices ({why}): {listed}",
            hint="use a rank well below the model's width (PowerSGD's paper uses 1-4; loom's default is 4), or "
            "parallel.grad_compression=bf16",
        )
    log.warn(f"parallel.powersgd_rank={r}: PowerSGD sends these matrices whole ({why}): {listed}")


def apply_compression(
    ddp: DistributedDataParallel, kind: str, rank: int, warmup: int, waits: BucketWaits | None = None
) -> SyncBytes:
    """Register the communication hook of `kind` (none | bf16 | fp16 | powersgd) on `ddp`; returns the byte
    counter. `none` keeps DDP's built-in all-reduce and counts the buckets' bytes after backward instead.
    `waits` (the straggler monitor's, loom.distributed.stragglers): each bucket's launch and completion
    timed around the hook; under `none` the hook is then torch's `allreduce_hook`, which computes what the
    built-in all-reduce does (divide by the world size, then sum: the same numbers bit for bit)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if kind == "none":
        if waits is not None:
            ddp.register_comm_hook(ddp.process_group, waits.wrap(default.allreduce_hook))
        return SyncBytes(sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad))
    counter, group = SyncBytes(), ddp.process_group
    if kind == "powersgd":
        state = psgd.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=warmup)
        check_powersgd_rank(state, ddp.module)
        hook = psgd.powerSGD_hook
        counter.hook_state = saved = PowerSGDCheckpoint(state, ddp.module, torch.distributed.get_rank())

        def count(bucket) -> int:
            saved.before_hook(bucket)
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

    ddp.register_comm_hook(state, counted if waits is None else waits.wrap(counted))
    return counter
