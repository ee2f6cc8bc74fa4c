"""Checkpoint faults: a SIGKILL while a checkpoint is being written (the previous one must load), truncated,
bit-flipped, missing and tampered files (each detected and named; loom falls back to the newest valid
checkpoint), a disk too full for the next checkpoint (train.on_save_error=continue keeps training, stop
ends the run), and an I/O error half way through a write. Compared against the manifest's sizes and
SHA-256 and against the bytes of the previous checkpoint before and after."""

from __future__ import annotations

import errno
import hashlib
import shutil
import time
from pathlib import Path

import pytest
import torch
from faultkit import Proc, curve, last_step, run_inprocess, train_args, wait_for

from loom import checkpoint
from loom.errors import LoomError
from loom.metrics import read_jsonl

MODEL, OPTIM = "model/__0_0.distcp", "optim/__0_0.distcp"  # rank 0's shards of a one-process run


def tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def run_with_ckpts(char_data, tmp_path_factory) -> Path:
    """A finished 6-step run with checkpoints at steps 2, 4 and 6."""
    runs = tmp_path_factory.mktemp("ckpts")
    assert (
        run_inprocess(train_args(char_data, runs, "r", 6, "--train.ckpt_every=2", "--train.keep_last=5")) == 0
    )
    return runs / "r"


def test_sigkill_while_writing_a_checkpoint_leaves_the_previous_one(char_data, tmp_path):
    run = tmp_path / "r"
    p = Proc(train_args(char_data, tmp_path, "r", 12, "--train.ckpt_every=4", "--train.keep_last=1"),
             tmp_path / "out", env={"LOOM_FAULT_STALL_SAVE": "8"})  # fmt: skip
    marker = run / "ckpt" / "step_000008.tmp" / "STALLED"
    wait_for(marker.exists, p, what="the stalled write of step 8")
    before = tree_hash(run / "ckpt" / "step_000004")
    p.kill_all()
    assert (run / "ckpt" / "step_000008.tmp" / "model" / ".metadata").exists()  # half written, never renamed
    assert not (run / "ckpt" / "step_000008").exists()
    assert checkpoint.latest_valid(run / "ckpt") == run / "ckpt" / "step_000004"
    assert tree_hash(run / "ckpt" / "step_000004") == before
    t0 = time.monotonic()
    assert run_inprocess(["train", "--resume", str(run)]) == 0
    took = time.monotonic() - t0
    assert sorted(curve(run)) == list(range(1, 13)) and last_step(run) == 12
    assert [p.name for p in (run / "ckpt").iterdir()] == ["step_000012"]  # the stale .tmp is cleaned up
    print(f"\n[fault] SIGKILL during the write of step 8: step 4 loaded, run finished in {took:.1f}s")


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst / "ckpt"


def _flip_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _manifest_escape(step: Path) -> None:
    """A manifest that names a file outside the checkpoint folder."""
    m = step / "manifest.json"
    m.write_text(m.read_text().replace('"model/__0_0.distcp"', '"../../../etc/passwd"'))


DAMAGE = {
    "truncated": (lambda s: _truncate(s / MODEL), "__0_0.distcp' has", "manifest says"),
    "bit flip": (lambda s: _flip_bit(s / OPTIM), "optim/__0_0.distcp' does not match its SHA-256", "corrupt"),
    "missing rank shard": (lambda s: (s / MODEL).unlink(), "is missing model/__0_0.distcp", ""),
    "missing file": (lambda s: (s / "extra.pt").unlink(), "is missing extra.pt", ""),
    "no manifest": (lambda s: (s / "manifest.json").unlink(), "has no manifest.json", "incomplete"),
    "garbled manifest": (lambda s: (s / "manifest.json").write_text("{nope"), "unreadable manifest", ""),
    "manifest escape": (_manifest_escape, "manifest lists", "expected"),
    "state.json": (lambda s: _flip_bit(s / "state.json"), "state.json' does not match", ""),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_is_named_and_skipped(run_with_ckpts, tmp_path, kind):
    damage, text, more = DAMAGE[kind]
    ckpt = _copy(run_with_ckpts, tmp_path)
    damage(ckpt / "step_000006")
    with pytest.raises(LoomError) as e:
        checkpoint.load(ckpt / "step_000006")
    assert text in str(e.value) and more in str(e.value) and "step_000006" in str(e.value)
    assert checkpoint.latest_valid(ckpt) == ckpt / "step_000004"


def test_resume_falls_back_to_newest_valid(run_with_ckpts, tmp_path, capsys):
    ckpt = _copy(run_with_ckpts, tmp_path)
    _flip_bit(ckpt / "step_000006" / MODEL)
    capsys.readouterr()
    t0 = time.monotonic()
    assert run_inprocess(["train", "--resume", str(ckpt.parent), "--train.steps=7"]) == 0
    out = capsys.readouterr().out
    assert (
        "skipping checkpoint" in out and "step_000006/model/__0_0.distcp' does not match its SHA-256" in out
    )
    assert f"resumed from {ckpt / 'step_000004'} at step 4" in out
    print(f"\n[fault] bit flip in the newest checkpoint: fell back to step 4, {time.monotonic() - t0:.1f}s")


def test_resume_of_a_named_corrupt_step_is_refused(run_with_ckpts, tmp_path, capsys):
    ckpt = _copy(run_with_ckpts, tmp_path)
    _truncate(ckpt / "step_000004" / OPTIM)
    before = tree_hash(ckpt.parent)
    assert run_inprocess(["train", "--resume", str(ckpt / "step_000004")]) == 2
    err = capsys.readouterr().err
    assert "step_000004/optim/__0_0.distcp' has" in err and "(truncated or corrupt)" in err
    assert tree_hash(ckpt.parent) == before


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_disk_too_full_for_a_checkpoint(char_data, tmp_path, monkeypatch, capsys, policy):
    monkeypatch.setenv("LOOM_FAULT_FREE_BYTES", "4096")  # the writer believes 4 KiB are free
    args = train_args(char_data, tmp_path, "r", 6, "--train.ckpt_every=2", f"--train.on_save_error={policy}")
    rc = run_inprocess(args)
    out = capsys.readouterr()
    assert not any((tmp_path / "r" / "ckpt").glob("step_*"))  # nothing half written
    if policy == "continue":
        assert rc == 0 and last_step(tmp_path / "r") == 6  # the run went on to its end
        assert out.out.count("not enough disk space for checkpoint step") == 3  # steps 2, 4, 6
        errors = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "ckpt_error" in r]
        assert [r["step"] for r in errors] == [2, 4, 6]
    else:
        assert rc == 2 and last_step(tmp_path / "r") == 2  # stopped at the first failed save
        assert "not enough disk space for checkpoint step 2" in out.err and "MiB free" in out.err


def test_io_error_half_way_leaves_earlier_checkpoints(tmp_path, monkeypatch):
    tensors = {"model": {"w": torch.arange(10.0)}, "optim": {}, "extra": {}}
    first = checkpoint.save(tmp_path, 1, tensors, {"step": 1}, keep_last=3)
    before = tree_hash(first)
    real_save, calls = torch.save, []

    def full_disk(obj, f):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(LoomError, match="could not write checkpoint step 2.*No space left on device"):
        checkpoint.save(tmp_path, 2, tensors, {"step": 2}, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # the .tmp folder is gone
    assert tree_hash(first) == before and checkpoint.latest_valid(tmp_path) == first


def test_free_space_estimate_covers_the_written_size(tmp_path):
    tensors = {"model": {"w": torch.randn(300, 300)}, "optim": {"state": {0: {"m": torch.randn(300, 300)}}},
               "extra": {"rng": torch.get_rng_state()}}  # fmt: skip
    state = {"step": 3, "config": {"a": "b" * 1000}}
    need = checkpoint.estimate_bytes(tensors, state)
    path = checkpoint.save(tmp_path, 3, tensors, state, keep_last=1)
    written = sum(p.stat().st_size for p in path.iterdir())
    assert written <= need <= written + (2 << 20)
    with pytest.raises(LoomError, match="not enough disk space"):
        checkpoint.save(tmp_path, 4, tensors, state, keep_last=1, free_bytes=need - 1)
