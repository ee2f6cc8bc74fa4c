"""Every place loom reaches into torch's private names, and nowhere else (layer 0).

torch moves or renames what it keeps private (a leading underscore) between releases without notice. Each use
is one function or class here, named for what loom wants, with the torch versions it was checked on; loom's
other modules call these and never touch a private torch name themselves (`tests/unit/test_hygiene.py`).
`tests/unit/test_compat.py` resolves every one of them on the installed torch, so an upgrade that moves one
fails there, by name, rather than somewhere deep in a run.

Checked on torch 2.11 and 2.13 unless a function says otherwise. torch is imported inside each function: this
module sits below everything and is imported by modules that must stay light.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

# --- tensors and ops -------------------------------------------------------------------------------------


def local_tensor(t):
    """A DTensor's local shard as stored, without the autograd-aware `to_local()` (`DTensor._local_tensor`);
    None for anything that is not a DTensor. Checked on torch 2.11, 2.13."""
    return getattr(t, "_local_tensor", None)


def view_base(t):
    """The tensor a view was made from (`Tensor._base`), None for a tensor that is no view: autograd saves a
    weight as its transpose, a view of the parameter. Checked on torch 2.11, 2.13."""
    return t._base


def foreach_add_(tensors: list, value: float) -> None:
    """tensors[i] += value for each, one kernel (`torch._foreach_add_`). Checked on torch 2.11, 2.13."""
    import torch

    torch._foreach_add_(tensors, value)


def has_grouped_mm() -> bool:
    """Whether this torch has `torch._grouped_mm` (a CPU kernel from 2.13 on). Checked on torch 2.11, 2.13."""
    import torch

    return hasattr(torch, "_grouped_mm")


def grouped_mm(a, b, offs):
    """One grouped GEMM (`torch._grouped_mm`: rows of `a` grouped by the offsets `offs`, group g times b[g]).
    Resolves on torch 2.11 and 2.13; runs on CPUs from 2.13 (loom.model.moe.grouped_ok says where)."""
    import torch

    return torch._grouped_mm(a, b, offs=offs)


@functools.cache
def cpu_float8_matmul() -> None:
    """On a CPU, the float8 matmul torchao's Float8Linear calls (`aten::_scaled_mm`) computed as what it means:
    the float32 product of the scaled operands (per-tensor or per-row scales broadcast), plus the bias, in the
    output type. torch's own CPU kernel for it goes through oneDNN's reference float8 path on CPUs without float8
    units: 26 ms for a 128x32x96 product that takes 0.2 ms as float32 (2-core Xeon, torch 2.13), so a 0.1M-param
    fp8 model trained at 8 s a step. A CPU has no float8 arithmetic to be faithful to, and each result equals
    the oneDNN one to float32 rounding (4e-5 on values of 256); a float8 output is divided by scale_result, as
    torch's CPU kernel does. Registered once per process, for the CPU dispatch
    key only (a GPU keeps its kernel); torch warns once that it replaces a kernel. Checked on torch 2.11, 2.13."""
    import warnings

    import torch

    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        out = (a.float() * scale_a) @ (b.float() * scale_b)
        if bias is not None:
            out = out + bias
        if scale_result is not None:  # a float8 output's scale: divided by, as torch's CPU kernel does
            out = out / scale_result
        return out.to(out_dtype or a.dtype)

    _LIBRARIES.append(lib := torch.library.Library("aten", "IMPL"))  # a registration lives with its object
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Overriding a previously registered kernel"
        lib.impl("_scaled_mm", scaled_mm, "CPU")


_LIBRARIES: list = []


def module_parameters(module) -> dict:
    """The module's own parameters as the dict nn.Module keeps them (`nn.Module._parameters`): writing to it
    swaps a parameter without the checks of register_parameter. Checked on torch 2.11, 2.13."""
    return module._parameters


def record_memory_history(on: bool, max_entries: int = 100_000) -> None:
    """Start (or stop) recording the CUDA caching allocator's history with stack traces
    (`torch.cuda.memory._record_memory_history`). Checked on torch 2.11, 2.13 (resolves on a CPU build)."""
    import torch

    torch.cuda.memory._record_memory_history("all" if on else None, max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """The recorded history and live segments as a pickle for pytorch.org/memory_viz
    (`torch.cuda.memory._dump_snapshot`). Checked on torch 2.11, 2.13."""
    import torch

    torch.cuda.memory._dump_snapshot(path)


# --- process groups, meshes, DDP -------------------------------------------------------------------------


def flatten_mesh(mesh, dims: tuple[str, ...], name: str):
    """mesh[dims] as one flattened dimension called `name`, reachable later as mesh[name]
    (`DeviceMesh._flatten`). Checked on torch 2.11, 2.13."""
    return mesh[dims]._flatten(name)


def ddp_ignore(model, names: list[str]) -> None:
    """Parameters (and buffers) DDP leaves alone, by name
    (`DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`). Checked on torch 2.11, 2.13."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(names))


def all_to_all_single_autograd(*args, **kwargs):
    """all_to_all_single with a backward (the reverse exchange)
    (`torch.distributed._functional_collectives.all_to_all_single_autograd`). Checked on torch 2.11, 2.13."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as all_to_all

    return all_to_all(*args, **kwargs)


def fake_store():
    """The store of torch's fake process-group backend (`torch.testing._internal.distributed.fake_pg`).
    Checked on torch 2.11, 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode(**kwargs):
    """torch's FakeTensorMode (`torch._subclasses.fake_tensor`). Checked on torch 2.11, 2.13."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


@contextlib.contextmanager
def sharding_prop_without_fake_mode() -> Iterator[None]:
    """DTensor's sharding propagation finds no active fake mode, so it runs in one of its own
    (`torch.distributed.tensor._sharding_prop.detect_fake_mode`, patched for the duration), with the modes
    active around it (the dry run's fake mode and memory tracker) switched off while it runs
    (`ShardingPropagator._propagate_tensor_meta_non_cached`, wrapped): on torch 2.11 its own mode was pushed
    above the tracker, which counted its whole-tensor shadows (the clip's `_foreach_norm`: every gradient at
    its global shape). Checked on torch 2.11, 2.13."""
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch.utils._python_dispatch import _disable_current_modes

    prop = sharding_prop.ShardingPropagator
    old_detect, old_meta = sharding_prop.detect_fake_mode, prop._propagate_tensor_meta_non_cached

    def apart(self, *args, **kwargs):  # torch 2.11 pushes its mode on ours: the tracker counted the shadows
        with _disable_current_modes():
            return old_meta(self, *args, **kwargs)

    sharding_prop.detect_fake_mode = lambda *a, **k: None
    prop._propagate_tensor_meta_non_cached = apart
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = old_detect
        prop._propagate_tensor_meta_non_cached = old_meta


# --- tensor-parallel styles ------------------------------------------------------------------------------


def colwise_style(name: str, before_apply: Callable, on_output: Callable) -> type:
    """A ColwiseParallel (class `name`) that calls `before_apply(module)` before parallelizing a module and passes each output
    through `on_output(module, outputs, device_mesh)` before its own output hook (overrides
    `ColwiseParallel._apply` and `_prepare_output_fn`). Checked on torch 2.11, 2.13."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    class Style(ColwiseParallel):
        def _apply(self, module, device_mesh):
            before_apply(module)
            return super()._apply(module, device_mesh)

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            outputs = on_output(mod, outputs, device_mesh)
            return ColwiseParallel._prepare_output_fn(
                output_layouts, use_local_output, mod, outputs, device_mesh
            )

    Style.__name__ = Style.__qualname__ = name
    return Style


def style_partitioning_linear(cls: type, name: str, partition: Callable) -> type:
    """A subclass of a tensor-parallel style whose linear layers are partitioned by
    `partition(base, style, name, module, mesh)`, where `base(style, name, module, mesh)` is the style's own
    (`ParallelStyle._partition_linear_fn`, on ColwiseParallel and RowwiseParallel). Checked on torch 2.11, 2.13."""
    base = cls._partition_linear_fn

    def _partition_linear_fn(self, fqn, module, mesh):
        return partition(base, self, fqn, module, mesh)

    return type(name, (cls,), {"_partition_linear_fn": _partition_linear_fn})


# --- pipeline schedules ----------------------------------------------------------------------------------


def pipeline_stages(schedule) -> list:
    """The stages a schedule runs on this rank (`_stages` of a multi-stage schedule, `_stage` of a single-stage
    one). Checked on torch 2.11, 2.13."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def pipeline_static_shapes_supported() -> bool:
    """Whether pipeline stages take static shapes (`torch.distributed.pipelining._utils.InferenceMode`: torch
    2.13; 2.11 has no such switch)."""
    from torch.distributed.pipelining import _utils

    return hasattr(_utils, "InferenceMode")


def static_pipeline_shapes(schedule, inputs: list, outputs: list) -> None:
    """Give each of the schedule's stages on this rank its input and output shapes (example tensors: stage i
    takes inputs[i] and gives outputs[i]) and skip the warm-up vote over the process group, which reads values
    sent between ranks (`_user_meta`, `_inference_mode`, `_warmup_p2p`, `pipelining._utils`). Checked on torch
    2.13 only (pipeline_static_shapes_supported)."""
    from torch.distributed.pipelining._utils import InferenceMode, extract_tensor_metas

    for stage, x, out in zip(pipeline_stages(schedule), inputs, outputs, strict=True):
        stage._user_meta.inputs = extract_tensor_metas((x,))
        stage._user_meta.outputs = extract_tensor_metas((out,))

    def no_vote(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = no_vote


def wrap_pipeline_p2p_wait(wrap: Callable[[Callable], Callable]) -> bool:
    """Replace the function every pipeline schedule waits on its send and receive work through
    (`torch.distributed.pipelining.schedules._wait_batch_p2p(works)`) with `wrap(original)`; a second call
    wraps the original again, not the wrapper (`functools.wraps` keeps it as `__wrapped__`). False where this
    torch has no such function. Checked on torch 2.13."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_wait_batch_p2p", None)
    if original is None:
        return False
    original = getattr(original, "__wrapped__", original)
    schedules._wait_batch_p2p = functools.wraps(original)(wrap(original))
    return True


# --- FSDP2 communication ---------------------------------------------------------------------------------


def fsdp_default_comms() -> tuple[type, type] | None:
    """FSDP2's default all-gather and reduce-scatter (`DefaultAllGather`, `DefaultReduceScatter` of
    `torch.distributed.fsdp._fully_shard._fsdp_collectives`: what `set_custom_all_gather` /
    `set_custom_reduce_scatter` replace), to subclass; None where this torch has none. Checked on torch 2.13."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return None
    return DefaultAllGather, DefaultReduceScatter


def wrap_fsdp_all_reduce(wrap: Callable[[Callable], Callable]) -> bool:
    """Replace the all-reduce FSDP2's gradient reduction makes across HSDP's replicas (`dist.all_reduce` as
    `torch.distributed.fsdp._fully_shard._fsdp_collectives` calls it; FSDP2 has no custom hook for it) with
    `wrap(original)`, through a stand-in for that module's `dist` that hands out every other name as is; a
    second call wraps the original again. False where this torch has no such module. Checked on torch 2.11
    and 2.13."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    except ImportError:
        return False
    import torch.distributed as dist

    class TimedDist:
        all_reduce = staticmethod(functools.wraps(dist.all_reduce)(wrap(dist.all_reduce)))

        def __getattr__(self, name: str):
            return getattr(dist, name)

    collectives.dist = TimedDist()
    return True


def fsdp_param_groups(module) -> int:
    """How many parameter groups a fully_shard-ed module holds (custom comms need exactly one): torch 2.13's
    `module._get_fsdp_state()._fsdp_param_groups`, torch 2.11's one `_fsdp_param_group` (or None). Checked on
    torch 2.11 and 2.13."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return len(groups)
    return 0 if getattr(state, "_fsdp_param_group", None) is None else 1


# --- memory trackers (the dry run) -----------------------------------------------------------------------


class _NoHook:
    """A hook handle for a hook never registered (a frozen parameter's gradient hook)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _StepMixin:
    """What both trackers need for one training step, written against torch's tracker internals
    (`torch.distributed._tools.mem_tracker`, `fsdp2_mem_tracker`; checked on torch 2.11, 2.13).

    torch's trackers refuse a root module called a second time in forward (they take it for a second iteration);
    gradient accumulation and pipeline schedules call it once per micro-batch, so a root entered again in
    forward starts fresh per-module statistics (the device-wide counts, which are what is reported, go on)."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        """As torch's, for a model with frozen parameters too (LoRA's base): torch hooks every parameter's
        gradient and refuses a hook on one that takes none, so each frozen one is entered with handles that
        remove nothing."""
        for p in module.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles.setdefault(p, (_NO_HOOK, _NO_HOOK))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _forget_if_again(self, module) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if (
            module in self.memory_tracking
            and not self._mod_tracker.is_bw
            and self._mod_tracker.parents - {name} <= {"Global"}
        ):
            del self.memory_tracking[module]

    def _update_peak_stats(self, peak_state) -> None:
        """The device-wide peak only: torch's also updates every module's own peak, a loop over all modules on
        every op, and nothing here reads them."""
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def peak_snapshot(self) -> dict:
        """{device: {kind: bytes}} at the peak since the last restart_peak()."""
        return self._peak_mem_snap

    def restart_peak(self) -> None:
        """The next peak is measured from now on (from what is allocated now)."""
        from copy import deepcopy

        self._peak_mem_snap = deepcopy(self._curr_mem_snap)
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._curr_mem_snap.items()}


@functools.cache
def memory_trackers() -> tuple[type, type]:
    """(MemTracker, FSDPMemTracker) of torch, each extended for one training step of several micro-batches
    (`_StepMixin`); the FSDP one takes a list of FSDP roots (an interleaved pipeline holds two stages) and counts
    the gradients FSDP accumulates unsharded between syncs as unsharded gradients. Built on first use: torch's
    trackers are heavy to import."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.nn import ModuleList

    class StepMemTracker(_StepMixin, MemTracker):
        def _pre_fw_hook(self, module, inputs):
            self._forget_if_again(module)
            return super()._pre_fw_hook(module, inputs)

    class FSDPStepMemTracker(_StepMixin, FSDPMemTracker):
        def __init__(self, roots: list, optimizer):
            super().__init__(roots[0], optimizer)
            self._root_mod = ModuleList(roots)

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig):
            """As torch's, and the gradients FSDP accumulates unsharded between syncs (in the reduce dtype,
            while no_sync skips the reduce-scatter) counted as unsharded gradients, not as backward
            temporaries."""
            inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

            def counted(*args, **kwargs):
                out = inner(*args, **kwargs)
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                for fsdp_param in group.fsdp_params if group else []:
                    if fsdp_param.unsharded_accumulated_grad is not None:
                        self._update_and_maybe_create_winfos(
                            fsdp_param.unsharded_accumulated_grad, _FSDPRefType.UNSHARDED_GRAD
                        )
                return out

            return counted

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args, **kwargs):
                self._forget_if_again(fsdp_mod)
                return inner(*args, **kwargs)

            return again

    return StepMemTracker, FSDPStepMemTracker
