"""One process as rank r of a world of N, with tensors that have shapes and no storage.

torch's fake process-group backend (`FakeStore`, backend "fake") answers every collective at once without
moving a byte, so a mesh of 512 ranks builds in one process; under `FakeTensorMode` every tensor is a shape,
dtype and device with no memory behind it, so a 70B model's shards, gradients, optimizer state and
activations cost nothing. torch's memory trackers (`torch.distributed._tools`) count what a step would have
allocated, tensor by tensor, on the device it names.

What the real path needs adapting to run here, each undone when the role is done (none of it changes loom's
code, only what a few functions do inside a dry run):
  * parallelize() runs outside the fake mode (its DeviceMesh reads rank coordinates off small tensors, which
    fake tensors cannot give), and only the allocations inside it, materializing the meta-built model and
    the DDP wrapper, run inside it;
  * DDP's C++ reducer cannot take fake tensors: a pure data-parallel layout (dp_impl ddp/zero1 with tp = pp
    = 1) trains the unwrapped model and adds DDP's gradient buckets (one copy of the gradients) as a term;
  * DTensor's sharding propagation computes each op's output on global shapes in whatever fake mode is
    active; inside ours the tracker would count those whole-tensor shadows as allocations (torch 2.13's
    mem_tracker assumes propagation runs in a mode of its own), so here it gets one;
  * the dry run measures the GPU's code path on the CPU device: the model's CPU fast path (loom.model.cpu_paths:
    bf16 attention written out) is switched off, the norms follow CUDA autocast's fp32
    policy (CPU autocast leaves them in bf16), and RMSNorm saves what CUDA's fused kernel saves (the CPU's
    composite keeps two fp32 copies more);
  * torch's pipeline schedule votes over the process group on its first step and sends each stage's shapes
    to the next, values a fake backend cannot carry: each stage is given its shapes (static metadata) and
    the vote is skipped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from loom import compat


@contextlib.contextmanager
def fake_world(world: int, rank: int) -> Iterator[None]:
    """A fake default process group in which this process is `rank` of `world` (destroyed after)."""
    dist.init_process_group("fake", store=compat.fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fake_mode():
    return compat.fake_tensor_mode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def swapped(obj, name: str, value) -> Iterator[None]:
    """obj.name = value for the duration."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _inside(mode, fn):
    def run(*args, **kwargs):
        with mode:
            return fn(*args, **kwargs)

    return run


class DdpBuckets:
    """What the stand-in for DDP saw: the bytes of the gradient buckets DDP would have allocated."""

    def __init__(self):
        self.bytes = 0

    def apply(self, model: nn.Module, device, ignore: list[str] = (), process_group=None) -> nn.Module:
        # DDP (gradient_as_bucket_view=False, loom's) copies every gradient into buckets of the same dtype,
        # but for the parameters it ignores (expert weights under expert parallelism)
        skip = set(ignore)
        params = [p for n, p in model.named_parameters() if p.requires_grad and n not in skip]
        self.bytes = sum(p.numel() * p.element_size() for p in params)
        return model


@contextlib.contextmanager
def parallelize_fake(mode, ddp: DdpBuckets) -> Iterator[None]:
    """While loom.parallel.parallelize runs: its allocations (materialize) in `mode`, DDP replaced by `ddp`
    (and the straggler monitor's timed comm hook left off: there is no DDP to hook, and nothing to time)."""
    import loom.parallel.ddp as ddp_module
    import loom.parallel.init as init_module

    compress = ddp_module.apply_compression

    def untimed(model, kind, rank, warmup, waits=None):
        return compress(model, kind, rank, warmup, None)

    with swapped(init_module, "materialize", _inside(mode, init_module.materialize)):
        with swapped(ddp_module, "apply_ddp", ddp.apply), swapped(ddp_module, "apply_compression", untimed):
            yield


def _never(t: torch.Tensor) -> bool:
    return False


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm kernel (aten._fused_rms_norm) as memory sees it, for fake tensors only (it computes
    nothing): an output like the input and a fp32 rstd per row, the input, weight and rstd saved for backward.
    On a CPU the same op is a composite that saves the fp32 input and the normalised product too."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        return torch.empty_like(x), None if weight is None else torch.empty_like(weight)


def _rms_norm(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _FusedRMSNorm.apply(x, self.weight)


def _fp32_policy(forward):
    """CUDA autocast's policy for the norms (AT_FORALL_FP32 in ATen's autocast_mode.h: layer_norm, rms_norm run
    in fp32 on fp32 copies of their inputs and return fp32; CPU autocast runs them in the input's dtype)."""

    def run(self, x):
        if not torch.is_autocast_enabled(x.device.type):
            return forward(self, x)
        with torch.autocast(x.device.type, enabled=False):
            w, b = getattr(self, "weight", None), getattr(self, "bias", None)
            with swapped_params(self, w, b):
                return forward(self, x.float())

    return run


@contextlib.contextmanager
def swapped_params(module: nn.Module, weight, bias) -> Iterator[None]:
    """The module's weight and bias as fp32 copies (autocast's casts) for one call."""
    saved, params = {}, compat.module_parameters(module)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != torch.float32:
            saved[name] = params[name]
            params[name] = t.float()
    try:
        yield
    finally:
        params.update(saved)


@contextlib.contextmanager
def gpu_paths() -> Iterator[None]:
    """The GPU's code path on the CPU device: the model's CPU fast paths off, CUDA's fused RMSNorm and autocast's
    fp32 policy for the norms; and DTensor's propagation in a fake mode of its own."""
    import loom.model.cpu_paths as cpu_paths

    with contextlib.ExitStack() as stack:
        stack.enter_context(swapped(cpu_paths, "cpu_bf16_autocast", _never))
        stack.enter_context(swapped(nn.RMSNorm, "forward", _fp32_policy(_rms_norm)))
        stack.enter_context(swapped(nn.LayerNorm, "forward", _fp32_policy(nn.LayerNorm.forward)))
        stack.enter_context(compat.sharding_prop_without_fake_mode())
        yield


def static_pipeline(pipeline, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    """Give each of this rank's pipeline stages its input and output shapes (`inputs[i]`, `outputs[i]`: example
    tensors of stage i of the rank) and skip the schedule's warm-up vote, which reads values sent over the
    process group."""
    compat.static_pipeline_shapes(pipeline.schedule, inputs, outputs)


# torch's trackers, extended for one step of several micro-batches (loom.compat: their internals)
_MemTracker, _FSDPMemTracker = compat.memory_trackers()


class _Phases:
    """Phases: `mark(name)` closes the phase under way and keeps its peak's terms, so that each phase of the step
    can be followed on its own (loom.dryrun.blocks extends them one by one: which phase peaks can change with the
    model's size)."""

    def mark(self, phase: str) -> None:
        """Close the phase under way as `phase`: its peak's terms into self.phases (a phase that recurs, as in
        each accumulation micro-step, keeps its highest peak)."""
        if not hasattr(self, "phases"):
            self.phases: dict[str, dict[str, int]] = {}
        at = terms(self.peak_snapshot())
        if phase not in self.phases or at["total"] > self.phases[phase]["total"]:
            self.phases[phase] = at
        self.restart_peak()  # the next phase's peak starts from here


class StepTracker(_Phases, _MemTracker):
    """MemTracker (no FSDP), for a step with several micro-batches."""


class FSDPStepTracker(_Phases, _FSDPMemTracker):
    """FSDPMemTracker over every FSDP root of this rank (an interleaved pipeline holds two stages), for a step
    with several micro-batches."""


# the trackers' kinds of memory -> the terms the dry run reports
TERMS = {
    "params": ("PARAM", "SHARDED_PARAM", "BUFFER"),
    "grads": ("GRAD", "SHARDED_GRAD"),
    "optim": ("OPT",),
    "activations": ("ACT", "TEMP", "INP", "OTH"),  # saved activations, backward temporaries, the batch
    # FSDP's unsharded blocks: gathered parameters, gradients before (or accumulated between) reduce-scatters
    "gathered": ("UNSHARDED_PARAM", "UNSHARDED_GRAD", "ALL_GATHER", "REDUCE_SCATTER"),
}


def terms(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot ({device: {kind: bytes}}) summed over devices into TERMS, plus 'total'."""
    out = dict.fromkeys([*TERMS, "total"], 0)
    for snap in snapshot.values():
        for kind, v in snap.items():
            name = getattr(kind, "name", kind)
            if name == "Total":
                out["total"] += v
                continue
            for term, kinds in TERMS.items():
                if name in kinds:
                    out[term] += v
    return out
