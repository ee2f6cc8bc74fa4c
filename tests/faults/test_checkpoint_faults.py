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
from loom.distributed.comm import Control
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
    p = Proc(
        train_args(char_data, tmp_path, "r", 12, "--train.ckpt_every=4", "--train.keep_last=1"),
        tmp_path / "out",
        env={"LOOM_FAULT_STALL_SAVE": "8"},
    )
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


def test_ranks_fall_back_together_from_a_shard_only_one_rank_hashes(char_data, tmp_path, capfd):
    """2 FSDP ranks each hash their own shards of the checkpoint they resume (checkpoint.newest_intact): a bit
    flip in rank 1's shard of the newest step is found by rank 1 alone, named by rank 0, and both fall back to
    the step before."""
    args = train_args(char_data, tmp_path, "r", 4, "--train.ckpt_every=2", "--train.keep_last=5")
    assert run_inprocess([*args, "--nproc", "2", "--parallel.dp_impl=fsdp"]) == 0
    ckpt = tmp_path / "r" / "ckpt"
    _flip_bit(ckpt / "step_000004" / "model" / "__1_0.distcp")
    capfd.readouterr()
    assert run_inprocess(["train", "--resume", str(ckpt.parent), "--train.steps=5", "--nproc", "2"]) == 0
    out = "".join(capfd.readouterr())
    assert (
        "skipping checkpoint" in out and "step_000004/model/__1_0.distcp' does not match its SHA-256" in out
    )
    assert f"resumed from {ckpt / 'step_000002'} at step 2" in out


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
        # the run went on to its end, but its final checkpoint has no next save to make up for it (issue 27
        # item 1: this exited 0 with no checkpoint): tried twice, then the run fails and says what is lost
        assert rc == 2 and last_step(tmp_path / "r") == 6
        assert out.out.count("not enough disk space for checkpoint step") == 4  # steps 2, 4, and 6 twice
        errors = [r for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "ckpt_error" in r]
        assert [r["step"] for r in errors] == [2, 4, 6, 6]
        assert "the final checkpoint of step 6 could not be saved (tried twice" in out.err
        assert "steps 1-6 of this run are in no checkpoint" in out.err and "hint: free disk space" in out.err
    else:
        assert rc == 2 and last_step(tmp_path / "r") == 2  # stopped at the first failed save
        assert "not enough disk space for checkpoint step 2" in out.err and "MiB free" in out.err


def _save(ckpt_dir: Path, step: int, tensors: dict, state: dict, keep_last: int, **hooks) -> Path:
    """The writer training uses (checkpoint.save_sharded), in one process."""
    return checkpoint.save_sharded(
        ckpt_dir,
        step,
        tensors["model"],
        tensors["optim"],
        tensors["extra"],
        state,
        keep_last,
        Control(),
        **hooks,
    )


def test_io_error_half_way_leaves_earlier_checkpoints(tmp_path, monkeypatch):
    tensors = {"model": {"w": torch.arange(10.0)}, "optim": {"state.w.exp_avg": torch.ones(10)}, "extra": {}}
    first = _save(tmp_path, 1, tensors, {"step": 1}, keep_last=3)
    before = tree_hash(first)
    real_save, calls = torch.save, []

    def full_disk(obj, f):  # extra.pt, written after the model's and the optimizer's shards
        calls.append(f)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(LoomError, match="could not write checkpoint step 2.*No space left on device"):
        _save(tmp_path, 2, tensors, {"step": 2}, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # the .tmp folder is gone
    assert tree_hash(first) == before and checkpoint.latest_valid(tmp_path) == first


def test_free_space_estimate_covers_the_written_size(tmp_path):
    tensors = {
        "model": {"w": torch.randn(300, 300)},
        "optim": {"state": {0: {"m": torch.randn(300, 300)}}},
        "extra": {"rng": torch.get_rng_state()},
    }
    state = {"step": 3, "config": {"a": "b" * 1000}}
    # what save_sharded checks: the shards' estimate and, on rank 0, extra.pt's and state.json's
    parts = {"model": tensors["model"], "optim": tensors["optim"]}
    need = checkpoint.estimate_bytes(parts, {}) + checkpoint.estimate_bytes(tensors["extra"], state)
    path = _save(tmp_path, 3, tensors, state, keep_last=1)
    written = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert written <= need <= written + (2 << 20)
    with pytest.raises(LoomError, match="not enough disk space"):
        _save(tmp_path, 4, tensors, state, keep_last=1, free_bytes=need - 1)
    assert not (tmp_path / "step_000004.tmp").exists()
    assert _save(tmp_path, 4, tensors, state, keep_last=1, free_bytes=need).name == "step_000004"


def test_final_checkpoint_is_retried_once(char_data, tmp_path, monkeypatch, capsys):
    """Issue 27 item 1: a final save that fails once (a full disk freed meanwhile, a flaky mount) is tried
    again and the run ends saved; before, it warned "the next save tries again" (there is none) and exited 0."""
    real, calls = checkpoint.save_sharded, []

    def flaky(ckpt_dir, step, *args, **kwargs):
        calls.append(step)
        if len(calls) == 1:
            raise LoomError(f"could not write checkpoint step {step}: Input/output error")
        return real(ckpt_dir, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_sharded", flaky)
    assert run_inprocess(train_args(char_data, tmp_path, "r", 3)) == 0
    out = capsys.readouterr().out
    assert calls == [3, 3] and "retrying the final checkpoint of step 3 once" in out
    assert "the next save tries again" not in out
    assert checkpoint.latest_valid(tmp_path / "r" / "ckpt") == tmp_path / "r" / "ckpt" / "step_000003"


def test_final_checkpoint_that_cannot_be_written_fails_the_run(char_data, tmp_path, monkeypatch, capsys):
    """Issue 27 item 1: a ckpt/ that takes no file (read-only, full) at the last step: exit 2 naming the step,
    the newest checkpoint that holds the run and how to continue; never "done" with exit 0."""
    monkeypatch.setenv("LOOM_FAULT_DISK_FULL", "6")  # every write of step 6 fails half way (ENOSPC)
    args = train_args(char_data, tmp_path, "r", 6, "--train.ckpt_every=4", "--train.on_save_error=continue")
    assert run_inprocess(args) == 2
    out = capsys.readouterr()
    ckpt = tmp_path / "r" / "ckpt"
    assert "the final checkpoint of step 6 could not be saved (tried twice" in out.err
    assert "No space left on device" in out.err and "steps 5-6 of this run are in no checkpoint" in out.err
    assert f"--resume continues from step 4 ('{ckpt / 'step_000004'}')" in out.err
    assert "the next save tries again" not in out.out
    assert [p.name for p in ckpt.iterdir()] == ["step_000004"]  # nothing half written left behind


def test_free_space_is_judged_by_the_real_size(char_data, tmp_path, monkeypatch):
    """Issue 27 item 1: the estimate added a fixed 1 MiB per state dict, so a ~0.1 MiB checkpoint was refused
    with 2 MiB free. Now a disk a little larger than the checkpoint takes it, and one byte less than what it
    really writes is still refused before anything is written."""
    assert run_inprocess(train_args(char_data, tmp_path, "a", 2)) == 0
    step = tmp_path / "a" / "ckpt" / "step_000002"
    written = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    assert written < 1 << 20
    monkeypatch.setenv("LOOM_FAULT_FREE_BYTES", str(int(written * 1.5)))
    assert run_inprocess(train_args(char_data, tmp_path, "b", 2)) == 0
    assert checkpoint.latest_valid(tmp_path / "b" / "ckpt") == tmp_path / "b" / "ckpt" / "step_000002"
    monkeypatch.setenv("LOOM_FAULT_FREE_BYTES", str(written - 1))
    assert run_inprocess(train_args(char_data, tmp_path, "c", 2)) == 2
    assert not any((tmp_path / "c" / "ckpt").glob("step_*"))


def test_keep_last_never_keeps_a_corrupt_checkpoint_in_place_of_a_valid_one(char_data, tmp_path, capsys):
    """Issue 42 item 3: step 4's bits flipped (its sizes intact). The resume finds it corrupt and falls back to
    step 2; keep_last=2 still counted step 4 (pruning checks sizes only) and deleted step 2, then step 3: the
    run kept one valid checkpoint and a corrupt one. Now what a resume hashed and found corrupt does not count
    (it is named and left in place), so the two newest valid checkpoints are kept."""
    args = train_args(char_data, tmp_path, "r", 4, "--train.ckpt_every=2", "--train.keep_last=2")
    assert run_inprocess(args) == 0
    ckpt = tmp_path / "r" / "ckpt"
    shard = ckpt / "step_000004" / MODEL
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = train_args(
        char_data, tmp_path, "r", 6, "--train.ckpt_every=3", "--train.keep_last=2", "--resume"
    )
    assert run_inprocess(resumed) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_000002" in out
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000003", "step_000004", "step_000006"]
    assert "step_000004' failed its SHA-256 check (corrupt): train.keep_last does not count it" in out
    for step in ("step_000003", "step_000006"):
        checkpoint.verify(ckpt / step)
