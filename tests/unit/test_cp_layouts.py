"""Context parallel composed with FSDP, tensor and pipeline parallel (issue 30, item 1): the layouts
validate() accepts, FSDP's shard degree dp_shard x cp, and the gradient-norm's count of the ranks that hold
each gradient on a mesh with a cp dimension (a fake world of 16 processes; the comparison against one
process with real ones is tests/distributed/test_cp_compose.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from loom.config import ParallelDims, load_config, validate
from loom.parallel.grads import replicas


def test_cp_composes_with_fsdp_tp_and_pp():
    cfg = load_config(
        None,
        [
            "--parallel.cp=2",
            "--parallel.tp=2",
            "--parallel.pp=2",
            "--parallel.dp_impl=fsdp",
            "--model.n_layer=4",
        ]
        + ["--parallel.pp_microbatches=2"],
    )
    _, dims = validate(cfg, 16, rank=5)
    assert (dims.dp, dims.cp, dims.tp, dims.pp, dims.dp_impl) == (2, 2, 2, 2, "fsdp")
    assert dims.fsdp_enabled and dims.fsdp_shard == 4  # dp_shard 2 x cp 2
    assert (dims.tp_rank, dims.cp_rank, dims.dp_rank, dims.pp_rank) == (1, 0, 1, 0)
    _, alone = validate(load_config(None, ["--parallel.cp=2", "--parallel.dp_impl=fsdp"]), 2)
    assert alone.dp == 1 and alone.fsdp_enabled and alone.fsdp_shard == 2  # FSDP over the cp ranks only


@pytest.fixture
def fake_world_16():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    yield
    dist.destroy_process_group()


def test_replicas_count_the_ranks_holding_each_gradient(fake_world_16):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dims = ParallelDims(2, 1, 2, 2, 16, 0, "fsdp", cp=2)
    mesh = dims.build_mesh("cpu")
    hsdp = mesh["dp_replicate", "dp_shard_cp", "tp"]
    norm_w = distribute_tensor(torch.ones(8), hsdp, (Replicate(), Shard(0), Replicate()))
    colwise = distribute_tensor(torch.ones(8, 8), hsdp, (Replicate(), Shard(0), Shard(0)))
    assert replicas(norm_w, dims) == 2 * 2  # the replicas and the tp ranks hold the same shard
    assert replicas(colwise, dims) == 2  # only the replicas
    assert replicas(torch.ones(3), dims) == 2 * 2 * 2  # a plain tensor: every rank of the stage
