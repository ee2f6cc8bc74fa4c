"""Data parallelism from scratch on MPI: mpi4py only, no torch.distributed (layer 3).

Every rank holds a full replica of the model, starts from the same weights (loom.parallel.init fills each from the run's seed and its name),
computes gradients on its own slice of the global batch, and averages gradients across ranks before
the optimizer step, so all replicas stay identical (Dean et al., "Large scale distributed deep
networks", 2012; Goyal et al., "Accurate, large minibatch SGD", 2017, for the averaging rule).

Two gradient synchronisers, as in picotron's `DataParallelNaive` / `DataParallelBucket`:

* `NaiveSync`: after backward, one blocking `Allreduce` per parameter. The readable reference.
* `BucketedSync`: gradients are packed into flat fp32 buckets of about `bucket_mb` MiB, in reverse
  registration order (the order backward produces them); each bucket's non-blocking `Iallreduce` is
  started by a post-accumulate-grad hook as soon as its last gradient is ready, so communication
  overlaps the rest of backward (Li et al., "PyTorch Distributed: experiences on accelerating data
  parallel training", VLDB 2020). Buckets are started in index order on every rank, as MPI requires
  non-blocking collectives on one communicator to be started in the same order everywhere.

Use under `mpiexec -n N`; the communicator comes from `mpi_comm()`. CUDA tensors are passed to MPI
directly when `cuda_aware_mpi()` says the library can read device memory, else staged through host.
mpi4py is imported inside functions only, so `import loom.parallel.mpi_dp` works without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from loom import device as dev
from loom.errors import LoomError
from loom.parallel.collectives import mpi_dtype, ring_allreduce

_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise LoomError(
            "mpi4py is not installed (needed for parallel.dp_impl=mpi)", hint="pip install 'loom[mpi]'"
        ) from e
    return MPI


def mpi_comm() -> Any:
    """MPI.COMM_WORLD, importing mpi4py only now; a LoomError with the install command if it is missing."""
    return _mpi().COMM_WORLD


def _libmpi_paths() -> list[str | None]:
    """Shared libraries named libmpi* already mapped into this process (Linux), then the process itself."""
    paths: list[str | None] = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi") and path not in paths:
                    paths.append(path)
    return [*paths, None]


def _mpix_query_cuda_support() -> int | None:
    """The result of MPIX_Query_cuda_support() from the loaded MPI library, or None if it has none."""
    for path in _libmpi_paths():
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        return int(fn())
    return None


def _ompi_info_cuda() -> bool:
    exe = shutil.which("ompi_info")
    if exe is None:
        return False
    try:
        out = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "mpi_built_with_cuda_support:value:true" in out


def cuda_aware_mpi() -> bool:
    """Best effort: can this MPI library read and write CUDA device memory directly?

    MPICH (and Open MPI builds with the CUDA extension) answer `MPIX_Query_cuda_support()`, which
    mpi4py does not wrap, so it is called through ctypes on the loaded libmpi. Open MPI without it:
    parse `ompi_info --parsable --all`. Anything else, or no mpi4py: False (the safe answer: tensors
    are then staged through host memory).
    """
    try:
        MPI = _mpi()
    except LoomError:
        return False
    answer = _mpix_query_cuda_support()
    if answer is not None:
        return bool(answer)
    if "Open MPI" in MPI.Get_library_version():
        return _ompi_info_cuda()
    return False


def _staged(t: torch.Tensor, cuda_aware: bool) -> tuple[Any, Callable[[], None]]:
    """An MPI buffer for tensor `t` and a function that writes the MPI result back into `t`.

    CPU float tensors are used in place (numpy view). CUDA tensors go to a CUDA-aware MPI as they are
    (after the stream has finished writing them). Everything else goes through a host fp32 copy.
    """
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and t.is_contiguous():
        arr = t.detach().numpy()
        return [arr, mpi_dtype(arr.dtype)], lambda: None
    if t.is_cuda and cuda_aware and t.is_contiguous():
        dev.current_stream(t.device).synchronize()
        return t, lambda: None
    host = t.detach().to("cpu", torch.float32).contiguous()
    return [host.numpy(), mpi_dtype(torch.float32)], lambda: t.copy_(host)


class _GradSync:
    """What both synchronisers share: the parameters to sync and the gradient-accumulation switch."""

    def __init__(self, model: nn.Module, comm: Any):
        self.model, self.comm = model, comm
        self.world_size = comm.Get_size()
        # model.parameters() yields a tied parameter once; frozen parameters have no gradient to sync.
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cuda_aware = any(p.is_cuda for p in self.params) and cuda_aware_mpi()
        self.require_sync = True

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """A sum over all ranks of a small tensor (losses, eval sums), through host memory."""
        host = t.detach().to("cpu", copy=True).contiguous()
        self.comm.Allreduce(_mpi().IN_PLACE, host.numpy(), op=_mpi().SUM)
        return host.to(t.device)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block backward only accumulates gradients locally; no communication.

        Use it for every micro-step of gradient accumulation but the last, which then all-reduces
        the accumulated gradients once (as `DistributedDataParallel.no_sync`).
        """
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


class NaiveSync(_GradSync):
    """One blocking `Allreduce` per parameter gradient after backward, then divide by the world size.

    The readable reference for `BucketedSync` (picotron's `DataParallelNaive`): as many collectives
    as there are parameters, and none of them overlaps backward. A parameter that received no
    gradient on this rank contributes zeros (every rank must take part in every collective).
    """

    def sync(self) -> None:
        """Average `.grad` over all ranks. Call after backward, before the optimizer step."""
        if not self.require_sync:
            return
        MPI = _mpi()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buf, write_back = _staged(p.grad, self.cuda_aware)
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            write_back()
            p.grad.div_(self.world_size)

    wait = sync


class _Bucket:
    """A flat fp32 buffer holding the gradients of a run of consecutive parameters."""

    def __init__(self, params: list[nn.Parameter], device: torch.device):
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets = list(itertools.accumulate([0, *self.numels[:-1]]))
        pin = device.type == "cpu" and dev.can_pin() and any(p.device.type != "cpu" for p in params)
        self.flat = torch.zeros(sum(self.numels), dtype=torch.float32, device=device, pin_memory=pin)
        self.ready: set[int] = set()  # slots whose gradient has been copied in this step

    @property
    def full(self) -> bool:
        return len(self.ready) == len(self.params)

    def view(self, slot: int) -> torch.Tensor:
        return self.flat[self.offsets[slot] : self.offsets[slot] + self.numels[slot]]

    def put(self, slot: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            self.view(slot).zero_()
        else:
            self.view(slot).copy_(grad.detach().reshape(-1))
        self.ready.add(slot)


class BucketedSync(_GradSync):
    """Bucketed gradient all-reduce overlapped with backward (picotron's `DataParallelBucket`, DDP).

    Parameters are taken in reverse registration order and packed into buckets of at most
    `bucket_mb` MiB of fp32 (a parameter larger than that gets a bucket of its own). A
    post-accumulate-grad hook copies each gradient into its bucket; when a bucket is full its
    all-reduce starts at once: non-blocking `Iallreduce` with `allreduce="mpi"`, or loom's blocking
    `ring_allreduce` with `allreduce="ring"`. `wait()` (alias `sync()`) must be called before the
    optimizer step: it starts any bucket still missing gradients (parameters unused on this rank
    contribute zeros), waits for all, divides by the world size and copies the result into `.grad`.

    Gradients are reduced in fp32 whatever the parameter dtype (float64 parameters lose precision).
    Under `no_sync()` the hooks do nothing and gradients accumulate in `.grad` as usual.
    """

    def __init__(self, model: nn.Module, comm: Any, bucket_mb: float = 25.0, allreduce: str = "mpi"):
        if not bucket_mb > 0:
            raise LoomError(
                f"bucket_mb must be > 0, got {bucket_mb}", hint="use e.g. 25 (PyTorch DDP's default)"
            )
        if allreduce not in ("mpi", "ring"):
            raise LoomError(
                f"unknown allreduce {allreduce!r}", hint='use "mpi" (Iallreduce) or "ring" (loom\'s own)'
            )
        super().__init__(model, comm)
        self.allreduce = allreduce
        self.bucket_mb = bucket_mb
        self.buckets = self._build_buckets(max(1, int(bucket_mb * 2**20) // 4))
        self._where = {
            id(p): (b, slot) for b, bucket in enumerate(self.buckets) for slot, p in enumerate(bucket.params)
        }
        self._next = 0  # index of the next bucket to start; buckets start in order on every rank
        self._requests: list[Any] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    def _build_buckets(self, cap: int) -> list[_Bucket]:
        buckets, current, size = [], [], 0
        for p in reversed(self.params):
            if current and size + p.numel() > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(current)
        # The ring all-reduce runs on host numpy buffers; Iallreduce reads device memory if MPI can.
        on_device = self.cuda_aware and self.allreduce == "mpi"
        return [_Bucket(ps, ps[0].device if on_device else torch.device("cpu")) for ps in buckets]

    @property
    def started(self) -> int:
        """How many buckets have had their all-reduce started since the last wait()."""
        return self._next

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_sync:
            return
        b, slot = self._where[id(p)]
        bucket = self.buckets[b]
        if b < self._next or slot in bucket.ready:
            raise LoomError(
                "a gradient was produced twice before wait()",
                hint="call wait() after every synchronised backward, and run earlier micro-steps under no_sync()",
            )
        with torch.no_grad():
            bucket.put(slot, p.grad)
        self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._start(self.buckets[self._next])
            self._next += 1
        if self._requests and self.allreduce == "mpi":
            # MPICH progresses non-blocking collectives only inside MPI calls: poke it while backward runs.
            _mpi().Request.Testall(self._requests)

    def _start(self, bucket: _Bucket) -> None:
        if bucket.flat.is_cuda:
            dev.current_stream(bucket.flat.device).synchronize()
        if self.allreduce == "ring":
            ring_allreduce(self.comm, bucket.flat.numpy())
            return
        MPI = _mpi()
        buf = bucket.flat if bucket.flat.is_cuda else [bucket.flat.numpy(), MPI.FLOAT]
        self._requests.append(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM))

    def wait(self) -> None:
        """Finish the gradient all-reduce and write the averaged gradients into `.grad`.

        Call after backward, before the optimizer step. Does nothing inside `no_sync()`.
        """
        if not self.require_sync:
            return
        with torch.no_grad():
            for bucket in self.buckets[self._next :]:
                for slot, p in enumerate(bucket.params):
                    if slot not in bucket.ready:
                        bucket.put(slot, p.grad)
            self._start_ready_buckets()
            if self._requests:
                _mpi().Request.Waitall(self._requests)
            for bucket in self.buckets:
                bucket.flat.div_(self.world_size)
                for slot, p in enumerate(bucket.params):
                    g = bucket.view(slot).view_as(p)
                    if p.grad is None:
                        p.grad = g.to(device=p.device, dtype=p.dtype, copy=True)
                    else:
                        p.grad.copy_(g)
                bucket.ready.clear()
        self._requests.clear()
        self._next = 0

    sync = wait
