"""Context parallel (parallel.cp, Ulysses; issue 30): the rules validate() checks before any process starts,
the rank grid with a cp dimension, the loader's sequence chunks, and Ulysses' two all-to-alls as exact
inverses (the distributed comparison against one process is tests/distributed/test_context_parallel.py).

Compared against: the whole rows (the chunks of cp ranks concatenated), the rank order dp x cp x tp, and the
identity (seq_to_head then head_to_seq)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loom.config import ParallelDims, load_config, validate
from loom.data.loader import ShardLoader, ValSet, seq_chunk
from loom.data.shards import write_shard
from loom.errors import LoomError
from loom.verify import STRATEGIES


def _validate(world: int, *overrides: str, dp_impl: str | None = None):
    return validate(load_config(None, list(overrides)), world, dp_impl=dp_impl)


@pytest.mark.parametrize(
    "world,overrides,match",
    [
        (3, ["--parallel.cp=3"], "does not divide model.block_size=128"),
        (8, ["--parallel.cp=8", "--model.block_size=64"], "does not divide model.n_kv_head=4"),
        (2, ["--parallel.cp=2", "--parallel.cp_impl=ring"], "cp_impl=ring is not built yet"),
        (2, ["--parallel.cp=2", "--parallel.dp_impl=mpi"], "does not compose with parallel.dp_impl=mpi"),
        (4, ["--parallel.cp=2", "--parallel.tp=2"], "built with data parallel by ddp only"),
        (4, ["--parallel.cp=2", "--parallel.dp_impl=fsdp"], "built with data parallel by ddp only"),
        (3, ["--parallel.cp=2"], "not divisible by parallel.cp x tp x pp = 2 x 1 x 1"),
    ],
)
def test_bad_layouts_fail_in_validate(world, overrides, match):
    with pytest.raises(LoomError, match=match) as e:
        _validate(world, *overrides)
    assert e.value.hint or "not divisible" in str(e.value)


def test_rank_grid_with_cp():
    _, dims = _validate(2, "--parallel.cp=2", "--parallel.dp_impl=none")
    assert (dims.dp, dims.cp, dims.dp_impl) == (1, 2, "ddp")  # cp ranks average their gradients
    derived, dims = _validate(4, "--parallel.cp=2")
    assert (dims.dp, dims.cp, dims.dp_impl, dims.rank) == (2, 2, "ddp", 0)
    assert derived.dp_size == 2 and derived.micro_batch_size == 8  # batch 16 splits over dp only, not cp
    grid = [ParallelDims(2, 1, 1, 1, 4, r, "ddp", cp=2) for r in range(4)]
    assert [(d.dp_rank, d.cp_rank) for d in grid] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "cp 2" in grid[0].describe() and "cp=2" in str(grid[0])
    assert "cp" not in ParallelDims().describe()
    s = STRATEGIES["cp-ulysses"]
    assert s.degrees(4) == (1, 1, 1) and s.cp_at(4) == 4 and "--parallel.cp=4" in s.argv(4, [])
    assert STRATEGIES["dp-cp"].degrees(4) == (2, 1, 1) and STRATEGIES["dp-cp"].cp_at(4) == 2


def test_loader_chunks_concatenate_to_the_rows(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50, 5000).astype(np.uint16)
    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", ids, 1)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    whole = ShardLoader(tmp_path, 8, 16, seed=0, dp_rank=1, dp_size=2).next_batch()
    parts = [ShardLoader(tmp_path, 8, 16, 0, 1, 2, cp_rank=r, cp_size=4).next_batch() for r in range(4)]
    for i in range(2):
        assert torch.equal(torch.cat([p[i] for p in parts], 1), whole[i]) and parts[0][i].shape == (4, 4)
    val = next(ValSet(tmp_path, 16, 4).batches(2))
    val_parts = [next(ValSet(tmp_path, 16, 4, cp_rank=r, cp_size=2).batches(2)) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in val_parts], 1), val[0])
    assert seq_chunk(whole[0], 0, 1) is whole[0]
