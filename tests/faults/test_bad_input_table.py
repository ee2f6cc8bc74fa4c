"""Bad input, table-driven: config files and keys, data directories and shards, parallel sizes, run
directories and checkpoints. Each row must give one clear message (asserted), a non-zero exit code, and
leave every existing file as it was (the whole tree is hashed before and after). Compared against that
contract, not against a reference implementation."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from faultkit import TINY

from loom.cli import main


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tree(char_data):
    """Data in good and broken forms, config files, a finished run with a checkpoint, a corrupt copy of
    it, and a folder this user may not write (chmod; as root, which ignores modes, chattr +i)."""
    root = Path(tempfile.mkdtemp(prefix="loom-badinput-"))
    shutil.copytree(char_data, root / "data")
    for name, damage in {"lies": "length", "badmagic": "magic", "badmeta": "meta"}.items():
        d = root / name
        shutil.copytree(char_data, d)
        shard = d / "train_000000.bin"
        if damage == "length":  # the header claims 100 more tokens than the file holds
            header = np.fromfile(shard, dtype="<i4", count=256)
            header[2] += 100
            shard.write_bytes(header.tobytes() + shard.read_bytes()[1024:])
        elif damage == "magic":
            raw = bytearray(shard.read_bytes())
            raw[0] ^= 0xFF
            shard.write_bytes(bytes(raw))
        else:
            (d / "meta.json").write_text("{not json")
    (root / "empty").mkdir()
    (root / "bad.toml").write_text("this is [not toml\n")
    (root / "section.toml").write_text("[modle]\nn_layer = 2\n")
    runs = root / "runs"
    assert main(["train", f"--data.path={root / 'data'}", f"--run.dir={runs}", "--run.name=ok", "--train.steps=2",
                 *TINY]) == 0  # fmt: skip
    shutil.copytree(runs / "ok", runs / "corrupt")
    model = runs / "corrupt" / "ckpt" / "step_000002" / "model.pt"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    model.write_bytes(bytes(raw))
    ro = root / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    immutable = False
    if os.access(ro, os.W_OK):  # root ignores permission bits; an immutable folder denies even root
        immutable = subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode == 0
    try:
        assert not os.access(ro, os.W_OK), "cannot make a folder this user may not write (chmod, chattr +i)"
        yield root
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        ro.chmod(0o755)
        shutil.rmtree(root)


# name -> (arguments after `loom train`, the message, the exit code)
CASES = {
    "config file that is not TOML": (["{root}/bad.toml"], "is not valid TOML", 2),
    "config file that does not exist": (["{root}/nope.toml"], "config file '{root}/nope.toml' does not exist", 2),
    "unknown config section in a file": (["{root}/section.toml"], "unknown config section 'modle'", 2),
    "unknown config key": (["--model.n_layers=2"], "did you mean 'model.n_layer'", 2),
    "value of the wrong type": (["--train.steps=many"], "config key 'train.steps' expects int, got 'many'", 2),
    "negative learning rate": (["--optim.lr=-0.001"], "lr > 0; got lr=-0.001", 2),
    "NaN learning rate": (["--optim.lr=nan"], "optim.lr must be a finite number, got nan", 2),
    "heads do not divide the width": (["--model.n_embd=30", "--model.n_head=4"], "not divisible by model.n_head", 2),
    "dropout of 1.5": (["--model.dropout=1.5"], "model.dropout must be in [0, 1), got 1.5", 2),
    "batch not divisible by micro-batch": (["--train.batch_size=10", "--train.micro_batch_size=4"],
                                           "train.batch_size=10 is not divisible by train.micro_batch_size=4", 2),
    "--nproc that does not divide the batch": (["--nproc=3"], "not divisible by the data-parallel size 3", 2),
    "--nproc 0": (["--nproc=0"], "--nproc must be >= 1, got 0", 2),
    "--nproc 2 with dp_impl=none": (["--nproc=2", "--parallel.dp_impl=none"], "with parallel.dp_impl=none", 2),
    "negative --max-restarts": (["--nproc=2", "--max-restarts=-1"], "--max-restarts must be >= 0, got -1", 2),
    "collective timeout of 0 s": (["--parallel.timeout_s=0"], "parallel.timeout_s must be positive, got 0.0", 2),
    "unknown on_save_error policy": (["--train.on_save_error=retry"], "must be one of continue, stop; got 'retry'", 2),
    "max_bad_steps of 0": (["--train.max_bad_steps=0"], "train.max_bad_steps must be positive, got 0", 2),
    "data directory that does not exist": (["--data.path={root}/nowhere"], "is not a directory", 2),
    "data directory that is not prepared": (["--data.path={root}/empty"], "not a prepared data directory", 2),
    "shard whose header lies about its length": (["--data.path={root}/lies"], "header says", 2),
    "shard with a wrong magic number": (["--data.path={root}/badmagic"], "not an llm.c/loom token shard", 2),
    "meta.json that is not JSON": (["--data.path={root}/badmeta"], "cannot read '{root}/badmeta/meta.json'", 2),
    "context longer than the data": (["--model.block_size=100000"], "larger than the", 2),
    "checkpoint from a different model shape": (["--resume", "{root}/runs/ok", "--model.n_embd=64"],
                                                "was trained with another model shape: model.n_embd: 32 -> 64", 2),
    "bit-flipped checkpoint named by --resume": (["--resume", "{root}/runs/corrupt/ckpt/step_000002"],
                                                 "model.pt' does not match its SHA-256 in the manifest", 2),
    "--resume of a run with no valid checkpoint": (["--resume", "{root}/runs/corrupt"], "no valid checkpoint", 2),
    "--resume of a run that does not exist": (["--resume", "--run.name=none"], "does not exist", 2),
    "existing run with another config": (["--run.name=ok", "--train.steps=5"],
                                         "already holds a run with a different config (train.steps: 2 -> 5)", 2),
    "run name that climbs out of run.dir": (["--run.name=../../x"], "must be a plain folder name", 2),
    "train.resume=auto without a run name": (["--train.resume=auto"], "train.resume=auto needs a run.name", 2),
    "run directory without write permission": (["--run.dir={root}/ro", "--run.name=x"], "is not writable", 2),
}  # fmt: skip
ROWS: list[str] = []


def _args(case: str, root: Path) -> list[str]:
    args = [a.format(root=root) for a in CASES[case][0]]
    if not any(a.startswith("--data.path") for a in args) and not args[0].endswith(".toml"):
        args.append(f"--data.path={root / 'data'}")
    if args[0].endswith(".toml"):
        args.append(f"--data.path={root / 'data'}")
    if not any(a.startswith("--run.dir") for a in args):
        args.append(f"--run.dir={root / 'runs'}")
    if args[0].endswith(".toml"):
        return ["train", args[0], "--train.steps=2", *TINY, *args[1:]]
    return ["train", "--train.steps=2", *TINY, *args]  # the row's own settings last: they win


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, tree, char_data, capsys):
    _, message, code = CASES[case]
    message = message.format(root=tree)
    argv = _args(case, tree)
    before = (_tree_hash(tree), _tree_hash(char_data))
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == code, err
    assert message in err, err
    assert err.count("loom: error:") == 1, err
    assert (_tree_hash(tree), _tree_hash(char_data)) == before  # nothing written, nothing changed
    first = err.split("loom: error: ", 1)[1].splitlines()[0].replace(str(tree), "…").replace("|", "\\|")
    ROWS.append(f"| {case} | {first} | {rc} |")


def test_zz_write_the_table(tmp_path_factory):
    """The markdown table of the rows above (printed with -s; written next to pytest's temp files)."""
    if len(ROWS) < len(CASES):
        pytest.skip("the table is written when every row ran")
    table = "\n".join(["| input | message | exit code |", "|---|---|---|", *ROWS])
    out = tmp_path_factory.getbasetemp() / "bad_input_table.md"
    out.write_text(table + "\n")
    print(f"\n{table}\n(written to {out})")
    assert len(ROWS) >= 20
