"""A disk that fills while `loom export` (hf, safetensors, peft) or `loom ckpt consolidate` writes: one
`loom: error:` naming --out and the remedy, exit 2, no traceback, and nothing left at --out that looks like a
complete output (they write beside it and rename when whole); an earlier export that --force would replace
is kept. Compared against what a full 100 KiB tmpfs gave: safetensors' SafetensorError "No space left on
device (os error 28)" and write()'s OSError ENOSPC without a file name (issue 42 item 4)."""

from __future__ import annotations

import errno

import pytest
from faultkit import fill_disk_in_save_file, run_inprocess, train_args

LLAMA = ["--model.family=llama", "--train.ckpt_every=2"]


@pytest.fixture(scope="module")
def runs(char_data, tmp_path_factory):
    """A 2-step llama run and a 1-step LoRA run fine-tuned from it."""
    root = tmp_path_factory.mktemp("fulldisk")
    assert run_inprocess(train_args(char_data, root, "base", 2, *LLAMA)) == 0
    lora = [f"--model.init_from=run:{root / 'base'}", "--finetune.lora_rank=2"]
    assert run_inprocess(train_args(char_data, root, "lora", 1, *LLAMA, *lora)) == 0
    return root


def _refused(capsys, out) -> None:
    err = capsys.readouterr().err
    assert f"loom: error: could not write --out '{out}': the disk is full (No space left on device)" in err
    assert "free some space, or give another --out" in err and "Traceback" not in err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))  # nothing half written left


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_export_onto_a_full_disk(runs, tmp_path, monkeypatch, capsys, fmt):
    out = tmp_path / "out"
    fill_disk_in_save_file(monkeypatch)
    assert run_inprocess(["export", str(runs / "base"), "--format", fmt, "--out", str(out)]) == 2
    _refused(capsys, out)


def test_peft_export_onto_a_full_disk_keeps_the_earlier_one(runs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "peft"
    assert run_inprocess(["export", str(runs / "lora"), "--format", "peft", "--out", str(out)]) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "base" / "config.json").is_file()
    fill_disk_in_save_file(monkeypatch)
    assert (
        run_inprocess(["export", str(runs / "lora"), "--format", "peft", "--out", str(out), "--force"]) == 2
    )
    err = capsys.readouterr().err
    assert (
        f"could not write --out '{out}': the disk is full" in err
        and "what it held before (an exported model) is untouched" in err
    )
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    out2 = tmp_path / "peft2"
    fill_disk_in_save_file(monkeypatch)
    assert run_inprocess(["export", str(runs / "lora"), "--format", "peft", "--out", str(out2)]) == 2
    _refused(capsys, out2)


def test_consolidate_onto_a_full_disk(runs, tmp_path, monkeypatch, capsys):
    from loom import checkpoint_tools

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")  # as write() raises it: no file name

    monkeypatch.setattr(checkpoint_tools, "_write_tensor", full)
    out = tmp_path / "whole"
    assert run_inprocess(["ckpt", "consolidate", str(runs / "base"), "--out", str(out)]) == 2
    _refused(capsys, out)
