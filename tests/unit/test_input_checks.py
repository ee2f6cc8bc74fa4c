"""The checks behind the bad-input table (tests/faults/test_bad_input_table.py), one level down: output
paths that cannot be written, endless inputs, the --nproc core warning, a bare value after an override,
the option a device error names, and ids beyond a meta.json's vocabulary. Compared against the contract
(which path or value the message names, what passes untouched), not against another implementation."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch

from loom import env
from loom.config import config_argv
from loom.data.formats import check_dir
from loom.errors import LoomError
from loom.paths import check_not_endless, check_output_dir, check_output_file
from loom.train.setup import resolve_device


def test_output_dir_accepts_new_and_existing_folders(tmp_path):
    check_output_dir(tmp_path / "new" / "deeper")  # created later, under a writable folder
    check_output_dir(tmp_path)  # exists, writable
    assert list(tmp_path.iterdir()) == []  # a check creates nothing


def test_output_paths_through_a_file_name_the_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(LoomError, match=f"'{f}' is a file, not a directory"):
        check_output_dir(f / "out", "--out")
    with pytest.raises(LoomError, match="--out '.*afile' is a file, not a directory"):
        check_output_dir(f, "--out")
    with pytest.raises(LoomError, match=f"--json '{f}/x.json' cannot be created: '{f}' is a file"):
        check_output_file(f / "x.json", "--json")
    with pytest.raises(LoomError, match="is a directory, not a file"):
        check_output_file(tmp_path, "--out")
    check_output_file(f, "--out")  # an existing file may be replaced


def test_unwritable_folder_is_refused(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) else real(p, mode))
    with pytest.raises(LoomError, match=f"--out '{ro}/x' is not writable \\('{ro}' denies"):
        check_output_dir(ro / "x", "--out")
    with pytest.raises(LoomError, match=f"--out '{ro}' is not writable"):
        check_output_dir(ro, "--out")
    with pytest.raises(LoomError, match="is not writable"):
        check_output_file(ro / "a" / "b.png", "--out")


def test_temp_beside_needs_the_parent_writable(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    check_output_dir(out, "--out")  # written into: fine
    with pytest.raises(LoomError, match=f"'{tmp_path}' denies"):
        check_output_dir(out, "--out", temp_beside=True)  # written beside it, then renamed


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_endless_inputs_are_refused(tmp_path):
    with pytest.raises(LoomError, match="--input '/dev/zero' is a device"):
        check_not_endless("/dev/zero", "--input")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    with pytest.raises(LoomError, match="is a named pipe"):
        check_not_endless(fifo, "--input")
    f = tmp_path / "f.txt"
    f.write_text("x")
    check_not_endless(f, "--input")
    check_not_endless(tmp_path, "--input")
    check_not_endless(tmp_path / "missing", "--input")  # left to the caller's own "does not exist"


def test_nproc_warning_names_the_usable_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert env.usable_cores() == 3
    assert env.oversubscription(3) is None
    msg = env.oversubscription(24)
    assert msg is not None and "--nproc 24" in msg and "on the 3 CPU cores" in msg and "at most 3" in msg


def test_bare_value_after_an_override():
    with pytest.raises(LoomError, match="write --train.steps=5"):
        config_argv(["--train.steps", "5"], "5", [])
    # after the file: fine
    assert config_argv(["configs/x.toml", "--train.steps", "5"], "configs/x.toml", []) == (
        "configs/x.toml",
        [],
    )
    assert config_argv(["--train.steps=5", "configs/x.toml"], "configs/x.toml", []) == ("configs/x.toml", [])
    assert config_argv(["--train.steps", "5"], None, ["--train.steps"]) == (None, ["--train.steps"])
    # an override argparse took for the config file goes back to the overrides
    assert config_argv(["--train.steps=5"], "--train.steps=5", ["--x"]) == (None, ["--train.steps=5", "--x"])


def test_device_errors_name_the_option_they_came_from():
    bad = "cuda:999"  # no such GPU, with or without CUDA
    if torch.cuda.is_available() and torch.cuda.device_count() > 999:
        pytest.skip("a machine with 1000 GPUs")
    with pytest.raises(LoomError) as e:
        resolve_device(bad, key="--device")
    assert "--device cuda:999" in str(e.value) and "train.device" not in str(e.value)
    with pytest.raises(LoomError, match="train.device 'bogus' is not a device"):
        resolve_device("bogus")


def test_ids_beyond_the_meta_vocabulary_are_refused(char_data, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(char_data, d)
    meta = json.loads((d / "meta.json").read_text())
    check_dir(d)  # as prepared: fine
    (d / "meta.json").write_text(json.dumps({**meta, "vocab_size": 3}))
    with pytest.raises(LoomError, match="outside the vocabulary of 3 ids"):
        check_dir(d)


def test_filesystem_refusals_after_the_checks_are_errors_not_tracebacks(monkeypatch, tmp_path, capsys):
    """A disk that fills up or a folder made read-only mid-command: `loom: error:` naming the file, exit 2.
    Any other exception (a bug) still raises with its traceback."""
    from loom import cli

    def full_disk(argv):
        raise OSError(28, "No space left on device", str(tmp_path / "out" / "x.bin"))  # ENOSPC

    def bug(argv):
        raise OSError("no errno, no file: a bug, not the environment")

    monkeypatch.setitem(cli.VERBS, "plot", (full_disk, ""))
    assert cli.main(["plot"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loom: error: ") and f"'{tmp_path / 'out' / 'x.bin'}'" in err and "No space" in err
    monkeypatch.setitem(cli.VERBS, "plot", (bug, ""))
    with pytest.raises(OSError, match="a bug"):
        cli.main(["plot"])
