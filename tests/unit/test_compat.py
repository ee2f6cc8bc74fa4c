"""Every private torch name loom uses (all of them in loom.compat) resolves on the installed torch.

Compared against: torch itself. An upgrade that moves or renames one of them fails here, by name, instead of deep
inside a run; each accessor's docstring says which torch versions it was checked on (2.11 and 2.13)."""

import pytest
import torch
import torch.nn as nn

from loom import compat

OLD_PIPELINE = not compat.pipeline_static_shapes_supported()


def test_tensor_and_module_accessors():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert compat.local_tensor(torch.zeros(1)) is None
    assert compat.module_parameters(nn.Linear(2, 2)).keys() == {"weight", "bias"}
    t = [torch.zeros(2), torch.ones(1)]
    compat.foreach_add_(t, 1.0)
    assert t[0].tolist() == [1.0, 1.0] and t[1].tolist() == [2.0]
    assert compat.has_grouped_mm() and hasattr(torch, "_grouped_mm")
    for style in (ColwiseParallel, RowwiseParallel):
        assert callable(style._partition_linear_fn)
    assert callable(ColwiseParallel._apply) and callable(ColwiseParallel._prepare_output_fn)
    assert compat.colwise_style("Head", lambda m: None, lambda m, o, d: o).__name__ == "Head"
    assert issubclass(
        compat.style_partitioning_linear(RowwiseParallel, "X", lambda *a: None), RowwiseParallel
    )


@pytest.mark.parametrize("rowwise", [False, True])
def test_cpu_float8_matmul_is_the_product_of_the_scaled_operands(rowwise):
    """After cpu_float8_matmul, torch._scaled_mm on a CPU (torchao's float8 matmul) equals its definition,
    computed in float64, to float32 rounding: per-tensor or per-row scales, a bias, a bf16 or fp32 output."""
    compat.cpu_float8_matmul()
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(48, 32, generator=g) * 3).to(torch.float8_e4m3fn)
    b = (torch.randn(64, 32, generator=g) * 3).to(torch.float8_e4m3fn).t()
    sa, sb = (
        (torch.rand(48, 1) + 0.5, torch.rand(1, 64) + 0.5)
        if rowwise
        else (torch.tensor(0.3), torch.tensor(2.0))
    )
    bias = torch.randn(64, generator=g)
    want = (a.double() * sa.double()) @ (b.double() * sb.double()) + bias.double()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        got = torch._scaled_mm(a, b, sa, sb, bias=bias.to(dtype), out_dtype=dtype)
        assert got.dtype == dtype
        assert torch.allclose(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # loom's kernel is the one called: bit for bit the float32 product (oneDNN's differs in the last bits)
    got = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32)
    assert torch.equal(got, (a.float() * sa) @ (b.float() * sb) + bias)
    fp8 = torch._scaled_mm(a, b, sa, sb, scale_result=torch.tensor(4.0), out_dtype=torch.float8_e4m3fn)
    assert torch.equal(fp8, (((a.float() * sa) @ (b.float() * sb)) / 4.0).to(torch.float8_e4m3fn))


def test_view_base():
    w = nn.Parameter(torch.zeros(2, 3))
    assert compat.view_base(w.t()) is w and compat.view_base(torch.zeros(1)) is None


def test_memory_history_accessors():
    assert callable(torch.cuda.memory._record_memory_history) and callable(torch.cuda.memory._dump_snapshot)


def test_distributed_accessors():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel

    assert callable(DeviceMesh._flatten)
    assert callable(DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)
    from torch.distributed._functional_collectives import all_to_all_single_autograd  # noqa: F401

    assert compat.fake_store() is not None
    with compat.fake_tensor_mode(allow_non_fake_inputs=True):
        pass
    with compat.sharding_prop_without_fake_mode():
        pass
    # a DTensor's local shard, on a one-rank fake world
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        d = distribute_tensor(torch.ones(2), mesh, [Replicate()])
        assert compat.local_tensor(d) is not None and compat.local_tensor(d).shape == (2,)
    finally:
        dist.destroy_process_group()


def test_memory_trackers():
    from torch.distributed._tools.mem_tracker import MemTracker

    plain, fsdp = compat.memory_trackers()
    assert issubclass(plain, MemTracker) and issubclass(fsdp, MemTracker)
    for name in ("_track_module_params_and_buffers", "_pre_fw_hook", "_update_peak_stats"):
        assert callable(getattr(MemTracker, name)), name
    for name in (
        "_fsdp_param_group_post_backward",
        "_fsdp_state_pre_forward",
        "_update_and_maybe_create_winfos",
    ):
        assert callable(getattr(fsdp, name)), name
    tracker = plain()
    for name in (
        "_param_to_grad_hook_handles",
        "_mod_tracker",
        "_curr_mem_snap",
        "_peak_mem",
        "_peak_mem_snap",
    ):
        assert hasattr(tracker, name), name
    model = nn.Linear(2, 2)
    model.bias.requires_grad_(False)  # a frozen parameter: the override's reason
    with tracker:
        model(torch.ones(1, 2)).sum().backward()
    assert tracker.peak_snapshot()
    tracker.restart_peak()


def test_pipeline_accessors():
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=1)
    try:
        stage = PipelineStage(nn.Linear(2, 2), stage_index=0, num_stages=1, device=torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=1)
        assert compat.pipeline_stages(schedule) == [stage]
        if OLD_PIPELINE:
            pytest.skip("static pipeline shapes need torch >= 2.13 (the rest resolved)")
        x = torch.ones(1, 2)
        compat.static_pipeline_shapes(schedule, [x], [stage.submod(x)])
        assert stage._user_meta.inputs and schedule._warmup_p2p.__name__ == "no_vote"
    finally:
        dist.destroy_process_group()


def test_fsdp_comms_and_pipeline_wait_accessors():
    """What the straggler monitor reaches (loom.distributed.stragglers): FSDP2's default comms to subclass, a
    module's parameter groups, and the schedules' P2P wait, wrapped once however often it is wrapped."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import schedules

    all_gather, reduce_scatter = compat.fsdp_default_comms()
    assert callable(all_gather()) and callable(reduce_scatter())
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=1)
    try:
        module = fully_shard(nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
        assert compat.fsdp_param_groups(module) == 1
    finally:
        dist.destroy_process_group()
    original, calls = schedules._wait_batch_p2p, []

    def wrap(f):
        def counted(works):
            calls.append(len(works))
            return f(works)

        return counted

    try:
        assert compat.wrap_pipeline_p2p_wait(wrap) and compat.wrap_pipeline_p2p_wait(wrap)
        schedules._wait_batch_p2p([])
        assert calls == [0] and schedules._wait_batch_p2p.__wrapped__ is original
    finally:
        schedules._wait_batch_p2p = original


def test_fsdp_all_reduce_wrapper_wraps_once_and_hands_out_the_rest():
    """HSDP's all-reduce across replicas, as FSDP2's reduction calls it (its module's `dist.all_reduce`):
    wrapped once however often it is wrapped; every other name of torch.distributed as it is."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    calls = []

    def wrap(f):
        def counted(*args, **kwargs):
            calls.append(f)
            return "summed"

        return counted

    try:
        assert compat.wrap_fsdp_all_reduce(wrap) and compat.wrap_fsdp_all_reduce(wrap)
        assert collectives.dist.all_reduce(None) == "summed" and calls == [dist.all_reduce]
        assert collectives.dist.ReduceOp is dist.ReduceOp and collectives.dist.reduce_scatter_tensor is (
            dist.reduce_scatter_tensor
        )
    finally:
        collectives.dist = dist
