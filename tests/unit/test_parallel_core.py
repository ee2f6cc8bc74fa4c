"""The parallel core's pieces that need no process group: ParallelDims against DeviceMesh's rank order, FSDP's
mixed-precision defaults, each rank's GPU from LOCAL_RANK, and the node-layout warning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.config import Config, ParallelConfig, validate
from loom.config.layout import ParallelDims
from loom.env import DistEnv
from loom.errors import LoomError
from loom.parallel.fsdp import mp_policy


@pytest.mark.parametrize("shape", [(1, 1, 4, 1), (1, 2, 2, 1), (2, 1, 2, 2), (2, 2, 1, 2), (1, 2, 2, 2)])
def test_coordinates_follow_the_mesh_order(shape):
    """init_device_mesh lays ranks out as arange(world).reshape(pp, dp_replicate, dp_shard, tp)."""
    pp, rep, shard, tp = shape
    world = pp * rep * shard * tp
    for rank in range(world):
        d = ParallelDims(rep, shard, tp, pp, world, rank, "fsdp")
        assert np.unravel_index(rank, shape) == (d.pp_rank, d.dp_replicate_rank, d.dp_shard_rank, d.tp_rank)
        assert d.dp_rank == d.dp_replicate_rank * shard + d.dp_shard_rank
    # every data-parallel rank reads a different batch shard; tp and pp ranks of one replica read the same
    ranks = [ParallelDims(rep, shard, tp, pp, world, r, "fsdp") for r in range(world)]
    assert sorted({d.dp_rank for d in ranks}) == list(range(rep * shard))


def _dims(p: ParallelConfig, world: int) -> ParallelDims:
    return validate(Config(parallel=p), world)[1]


def test_from_config():
    p = ParallelConfig(dp_impl="fsdp", dp_replicate=2)
    d = _dims(p, 8)
    assert (d.dp_replicate, d.dp_shard, d.dp, d.hsdp_enabled) == (2, 4, 8, True)
    d = _dims(ParallelConfig(dp_impl="ddp", tp=2), 8)
    assert (d.dp_replicate, d.dp_shard, d.fsdp_enabled, d.model_parallel) == (4, 1, False, True)
    assert "replicate 2 x shard 4" in _dims(p, 8).describe()
    with pytest.raises(LoomError, match="must equal"):
        _dims(ParallelConfig(dp_impl="fsdp", dp_replicate=3), 8)


def test_fsdp_mixed_precision_defaults():
    cuda = torch.device("cuda", 0)  # only inspected, never used
    mp = mp_policy("", "", cuda, "bf16")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)  # bf16 compute, fp32 sums
    mp = mp_policy("", "", cuda, "fp32")
    assert (mp.param_dtype, mp.reduce_dtype) == (None, None)  # fp32 training stays fp32
    mp = mp_policy("", "", torch.device("cpu"), "bf16")
    assert (mp.param_dtype, mp.reduce_dtype) == (None, None)  # CPUs: as stored unless asked
    mp = mp_policy("bf16", "", torch.device("cpu"), "fp32")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(LoomError, match="param_dtype"):
        mp_policy("fp8", "", torch.device("cpu"), "fp32")


def test_each_rank_gets_its_own_gpu_when_the_user_writes_cuda(monkeypatch):
    from loom.train.setup import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)
    assert resolve_device("auto", local_rank=2) == torch.device("cuda", 2)
    assert resolve_device("cuda:1", local_rank=3) == torch.device("cuda", 1)  # an explicit index is kept


def _env(per_node: int, nodes: int) -> DistEnv:
    return DistEnv(0, 0, per_node * nodes, per_node, 0, nodes, "h0", 29500, "torchrun")


def test_node_layout_warning(monkeypatch):
    from loom import log
    from loom.train import check_node_layout

    seen = []
    monkeypatch.setattr(log, "warn", seen.append)
    check_node_layout(ParallelDims(1, 16, 1, 1, 16, 0, "fsdp"), _env(8, 2))  # FSDP over both nodes
    assert len(seen) == 1 and "cross nodes" in seen[0] and "dp_replicate=2" in seen[0]
    check_node_layout(ParallelDims(2, 8, 1, 1, 16, 0, "fsdp"), _env(8, 2))  # HSDP: shards within a node
    check_node_layout(ParallelDims(16, 1, 1, 1, 16, 0, "ddp"), _env(8, 2))  # DDP: one all-reduce per step
    assert len(seen) == 1
    check_node_layout(ParallelDims(1, 1, 16, 1, 16, 0, "ddp"), _env(8, 2))
    assert len(seen) == 2 and "tensor-parallel" in seen[1]


def test_degree1_meshes_only_in_one_process():
    """parallel.degree1_meshes turns tp and pp on at degree 1 in a 1-process job (the GPU check), and only there."""
    p = ParallelConfig(dp_impl="fsdp", degree1_meshes=True)
    one = _dims(p, 1)
    assert one.tp_enabled and one.pp_enabled and one.dp_enabled and (one.tp, one.pp, one.dp) == (1, 1, 1)
    two = _dims(p, 2)
    assert not (two.tp_enabled or two.pp_enabled) and two.dp == 2
    assert not _dims(ParallelConfig(), 1).model_parallel
