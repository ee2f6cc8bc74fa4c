"""LR schedule against its formula, and checkpoints against their contract: atomic, pruned, verified."""

import math

import pytest
import torch

from loom import checkpoint
from loom.distributed.comm import Control
from loom.errors import LoomError
from loom.optim.schedule import lr_at


def test_warmup_then_cosine_to_min():
    lrs = [lr_at(s, 1.0, 0.1, 10, 111) for s in range(111)]  # decay spans steps 10..110
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert lrs[60] == pytest.approx(0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))


def _save(d, step, keep=3):
    """A one-process checkpoint through the writer training uses (save_sharded)."""
    w = torch.full((4,), float(step))
    return checkpoint.save_sharded(
        d, step, {"w": w}, {"state.w.exp_avg": w * 0.5}, {}, {"step": step}, keep, Control()
    )


def test_save_load_prune(tmp_path):
    for s in (1, 2, 3, 4):
        _save(tmp_path, s)
    assert [p.name for p in checkpoint.list_steps(tmp_path)] == ["step_000002", "step_000003", "step_000004"]
    tensors, state = checkpoint.load(tmp_path / "step_000004")
    assert state["step"] == 4 and torch.equal(tensors["model"]["w"], torch.full((4,), 4.0))
    assert not list(tmp_path.glob("*.tmp"))


def test_corrupt_and_incomplete_are_detected_and_skipped(tmp_path):
    _save(tmp_path, 1)
    p2 = _save(tmp_path, 2)
    data = bytearray((p2 / "model" / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p2 / "model" / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(LoomError, match="SHA-256"):
        checkpoint.verify(p2)
    assert checkpoint.latest_valid(tmp_path).name == "step_000001"
    (tmp_path / "step_000001" / "optim" / "__0_0.distcp").write_bytes(b"short")
    with pytest.raises(LoomError, match="bytes"):
        checkpoint.verify(tmp_path / "step_000001")
    (tmp_path / "step_000003.tmp").mkdir()  # a crash mid-write leaves only a .tmp, never a final name
    assert checkpoint.latest_valid(tmp_path) is None
    with pytest.raises(LoomError, match="no valid checkpoint"):
        checkpoint.resolve_resume(tmp_path, True)


def test_keep_last_counts_and_deletes_only_checkpoints(tmp_path):
    """Issue 27 item 5: a stray step_000099/ (no manifest) took a place among the kept ones, and the valid
    checkpoints were deleted to make room for it; a damaged checkpoint is not counted and not deleted either."""
    for s in (1, 2):
        _save(tmp_path, s, keep=2)
    stray = tmp_path / "step_000099"
    stray.mkdir()
    (stray / "notes.txt").write_text("a copy someone is still looking at")
    damaged = tmp_path / "step_000050"
    damaged.mkdir()
    (damaged / "manifest.json").write_text("{nope")
    _save(tmp_path, 3, keep=2)
    _save(tmp_path, 4, keep=2)
    names = [p.name for p in checkpoint.list_steps(tmp_path)]
    assert names == ["step_000003", "step_000004", "step_000050", "step_000099"]
    assert (stray / "notes.txt").read_text() == "a copy someone is still looking at"
    assert checkpoint.latest_valid(tmp_path).name == "step_000004"


def test_keep_last_does_not_count_a_checkpoint_found_corrupt(tmp_path):
    """Issue 42 item 3: a checkpoint whose bits were flipped (sizes intact) passed pruning's size check, so it
    took a place among the kept ones and the valid older one was deleted, though this process had hashed it and
    fallen back past it. Now it counts as damaged: not kept in place of a valid one, not deleted."""
    _save(tmp_path, 1, keep=2)
    p2 = _save(tmp_path, 2, keep=2)
    data = bytearray((p2 / "model" / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p2 / "model" / "__0_0.distcp").write_bytes(bytes(data))
    assert checkpoint.latest_valid(tmp_path).name == "step_000001"  # hashed: step 2 is corrupt
    _save(tmp_path, 3, keep=2)
    names = [p.name for p in checkpoint.list_steps(tmp_path)]
    assert names == ["step_000001", "step_000002", "step_000003"]  # the two valid ones, and the damaged one
    _save(tmp_path, 2, keep=2)  # the same step written again is a new, intact checkpoint
    assert [p.name for p in checkpoint.list_steps(tmp_path)] == ["step_000002", "step_000003"]
