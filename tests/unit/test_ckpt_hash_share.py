"""Ranks verify a checkpoint together (loom.checkpoint.hash_owner / verify(share=...)): rank k hashes shard
`__k_0.distcp` (mod the world size), rank 0 the rest; every rank still checks every file's presence and size."""

from __future__ import annotations

import pytest
import torch

from loom import checkpoint
from loom.distributed.comm import Control
from loom.errors import LoomError


def test_owner_of_each_file():
    assert [checkpoint.hash_owner(f"optim/__{k}_0.distcp", 4) for k in range(6)] == [0, 1, 2, 3, 0, 1]
    assert checkpoint.hash_owner("model/.metadata", 4) == 0 and checkpoint.hash_owner("extra.pt", 4) == 0


@pytest.fixture
def step(tmp_path):
    sd = {"w": torch.arange(64.0).reshape(8, 8)}
    return checkpoint.save_sharded(
        tmp_path,
        3,
        sd,
        {"state.w.exp_avg": torch.ones(8, 8)},
        {"x": 1},
        {"step": 3},
        keep_last=2,
        control=Control(),
    )


def test_only_the_owner_hashes_a_shard(step):
    f = step / "model" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    f.write_bytes(bytes(data))
    checkpoint.verify(step, share=(1, 2))  # rank 1 of 2 does not own it
    checkpoint.verify(step, share=None)  # presence and size only
    for share in ((0, 2), (0, 1)):
        with pytest.raises(LoomError, match="__0_0.distcp' does not match its SHA-256"):
            checkpoint.verify(step, share=share)


def test_every_rank_checks_presence_and_size(step):
    (step / "optim" / "__0_0.distcp").unlink()
    for share in ((1, 2), None):
        with pytest.raises(LoomError, match="missing optim/__0_0.distcp"):
            checkpoint.verify(step, share=share)


class _Rank1Of2(Control):
    """Rank 1 of a 2-rank job whose rank 0 reports `rank0_failed` (sums include rank 0's flag)."""

    def __init__(self, rank0_failed: bool):
        self.rank, self.size, self.rank0_failed = 1, 2, rank0_failed

    def all_reduce_sum(self, values):
        return [v + float(self.rank0_failed) for v in values]

    def gather_object(self, obj):
        return None  # only rank 0 receives


def test_ranks_agree_on_the_newest_intact(tmp_path):
    """newest_intact (resume of a job, eval/generate of a sharded model): the newest step every rank's share
    verifies; a damaged newer one is skipped with the rank's reason, on any rank that found it."""
    ckpt = tmp_path / "ckpt"
    steps = [
        checkpoint.save_sharded(
            ckpt, s, {"w": torch.full((4,), float(s))}, {}, {}, {"step": s}, keep_last=3, control=Control()
        )
        for s in (1, 2)
    ]
    assert checkpoint.share_errors(steps[1], Control()) is None
    assert checkpoint.newest_intact(steps, Control()) == steps[1]
    f = steps[1] / "model" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    errors = checkpoint.share_errors(steps[1], Control())
    assert len(errors) == 1 and "__0_0.distcp' does not match its SHA-256" in errors[0]
    assert checkpoint.newest_intact(steps, Control()) == steps[0]
    assert checkpoint.newest_intact(steps, Control(), model_only=True) == steps[0]
    # rank 1 does not own the damaged shard, yet follows rank 0's verdict: every rank picks the same step
    assert checkpoint.share_errors(steps[1], _Rank1Of2(rank0_failed=True)) == []
    assert checkpoint.newest_intact(steps[:1], _Rank1Of2(rank0_failed=False)) == steps[0]
    assert checkpoint.newest_intact([steps[1]], Control()) is None
