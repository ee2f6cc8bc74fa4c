"""Bad input, table-driven, through the real command line (`loom ...` in a process of its own): config files
and keys, data directories and shards, parallel sizes, run directories and checkpoints, and for every
command that writes, outputs it cannot write; endless inputs (/dev/zero, a FIFO); sampling options out of
their domain; zero or negative counts; messages that must name the real cause. Each row must exit 2 with
one `loom: error:` that names the bad value (asserted), no traceback, and leave every existing file as it
was (the whole tree, the working directory and the cache are hashed before and after). Compared against
that contract, not against a reference implementation.

test_the_table writes the table of rows and first message lines (printed with -s); every test here runs
on its own, in any order: rows are run once per module by a caching fixture, not through a module global.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from faultkit import TINY, ForkServer

from loom.cli import main


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _mix_sources(root: Path, char_data: Path) -> None:
    """Copies of the data for data.mix's rows: one whose meta gives more ids (another vocabulary), one whose
    char tokenizer has two characters swapped (same size, another tokenizer), one without an end-of-text id."""
    for name in ("othervocab", "othertok", "noeot"):
        shutil.copytree(char_data, root / name)
    meta = json.loads((root / "othervocab" / "meta.json").read_text())
    (root / "othervocab" / "meta.json").write_text(json.dumps({**meta, "vocab_size": meta["vocab_size"] + 8}))
    vocab = root / "othertok" / meta["tokenizer"]["file"]
    chars = json.loads(vocab.read_text())["chars"]
    chars[3], chars[4] = chars[4], chars[3]
    vocab.write_text(json.dumps({"chars": chars}))
    noeot = {**meta, "tokenizer": {k: v for k, v in meta["tokenizer"].items() if k != "eot_id"}}
    (root / "noeot" / "meta.json").write_text(json.dumps(noeot))


def _pairs(root: Path) -> None:
    """Preference pairs (loom dpo): good ones (JSONL, and prepared with a char tokenizer), and a file whose every
    pair prefers its answer to itself."""
    good = [{"prompt": f"say {w}", "chosen": w, "rejected": w[::-1]} for w in ("abc", "hello", "stone", "ab")]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    same = [{"prompt": f"say {w}", "chosen": w, "rejected": w} for w in ("abc", "hello")]
    (root / "same.jsonl").write_text("".join(json.dumps(r) + "\n" for r in same))
    args = ["data", "prepare", "--pairs", "--input", str(root / "pairs.jsonl"), "--out", str(root / "pref")]
    assert main([*args, "--tokenizer", "char", "--block-size", "32"]) == 0


@pytest.fixture(scope="module")
def tree(char_data):
    """Data in good and broken forms, config files, a finished run with a checkpoint, a corrupt copy of
    it, a run of another width, a folder this user may not write (chmod; as root, which ignores modes,
    chattr +i), a regular file where a folder is expected, a FIFO, and the subprocesses' working directory
    and cache."""
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
    _mix_sources(root, char_data)
    small = root / "smallvocab"  # a meta.json that claims 5 ids; the shards hold more
    shutil.copytree(char_data, small)
    meta = json.loads((small / "meta.json").read_text())
    (small / "meta.json").write_text(json.dumps({**meta, "vocab_size": 5}))
    (root / "afile").write_text("a regular file, not a folder\n")
    os.mkfifo(root / "fifo")
    (root / "cwd").mkdir()
    (root / "cache").mkdir()
    (root / "empty").mkdir()
    (root / "bad.toml").write_text("this is [not toml\n")
    _pairs(root)
    (root / "section.toml").write_text("[modle]\nn_layer = 2\n")
    runs = root / "runs"
    assert (
        main(
            [
                "train",
                f"--data.path={root / 'data'}",
                f"--run.dir={runs}",
                "--run.name=ok",
                "--train.steps=2",
                *TINY,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                f"--data.path={root / 'data'}",
                f"--run.dir={runs}",
                "--run.name=wide",
                "--train.steps=1",
                *TINY,
                "--model.n_embd=64",
            ]
        )
        == 0
    )
    shutil.copytree(runs / "ok", runs / "corrupt")
    # a run whose config is the moe family's (its checkpoint is gpt2's: export --format gguf must refuse first)
    from loom.config import load_config, to_toml

    shutil.copytree(runs / "ok", runs / "moe")
    moe = load_config(None, ["--model.family=moe", "--model.n_experts=4", "--model.moe_top_k=1", *TINY])
    (runs / "moe" / "config.toml").write_text(to_toml(moe))
    model = runs / "corrupt" / "ckpt" / "step_000002" / "model" / "__0_0.distcp"
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
    "config file that does not exist": (
        ["{root}/nope.toml"],
        "config file '{root}/nope.toml' does not exist",
        2,
    ),
    "unknown config section in a file": (["{root}/section.toml"], "unknown config section 'modle'", 2),
    "unknown config key": (["--model.n_layers=2"], "did you mean 'model.n_layer'", 2),
    "value of the wrong type": (
        ["--train.steps=many"],
        "config key 'train.steps' expects int, got 'many'",
        2,
    ),
    "negative learning rate": (["--optim.lr=-0.001"], "lr > 0; got lr=-0.001", 2),
    "NaN learning rate": (["--optim.lr=nan"], "optim.lr must be a finite number, got nan", 2),
    "heads do not divide the width": (
        ["--model.n_embd=30", "--model.n_head=4"],
        "not divisible by model.n_head",
        2,
    ),
    "dropout of 1.5": (["--model.dropout=1.5"], "model.dropout must be in [0, 1), got 1.5", 2),
    "batch not divisible by micro-batch": (
        ["--train.batch_size=10", "--train.micro_batch_size=4"],
        "train.batch_size=10 is not divisible by train.micro_batch_size=4",
        2,
    ),
    "--nproc that does not divide the batch": (["--nproc=3"], "not divisible by the data-parallel size 3", 2),
    "--nproc 0": (["--nproc=0"], "--nproc must be >= 1, got 0", 2),
    "--nproc 2 with dp_impl=none": (
        ["--nproc=2", "--parallel.dp_impl=none"],
        "with parallel.dp_impl=none",
        2,
    ),
    "context parallel not dividing block_size": (
        ["--nproc=3", "--parallel.cp=3"],
        "parallel.cp=3 does not divide model.block_size=16",
        2,
    ),
    "Ulysses with more cp ranks than key/value heads": (
        ["--nproc=4", "--parallel.cp=4"],
        "parallel.cp=4 with cp_impl=ulysses does not divide model.n_kv_head=2",
        2,
    ),
    "context parallel with dp_impl=mpi": (
        ["--parallel.cp=2", "--parallel.dp_impl=mpi"],
        "parallel.cp > 1 does not compose with parallel.dp_impl=mpi",
        2,
    ),
    "ring attention with document masks": (
        ["--nproc=2", "--parallel.cp=2", "--parallel.cp_impl=ring", "--data.doc_mask=true"],
        "data.doc_mask=true is not supported with parallel.cp_impl=ring",
        2,
    ),
    "ring attention whose 2*cp chunks do not divide block_size": (
        ["--nproc=2", "--parallel.cp=2", "--parallel.cp_impl=ring", "--model.block_size=30"],
        "needs 2*cp = 4 to divide model.block_size=30",
        2,
    ),
    "negative --max-restarts": (["--nproc=2", "--max-restarts=-1"], "--max-restarts must be >= 0, got -1", 2),
    "collective timeout of 0 s": (
        ["--parallel.timeout_s=0"],
        "parallel.timeout_s must be positive, got 0.0",
        2,
    ),
    "unknown on_save_error policy": (
        ["--train.on_save_error=retry"],
        "must be one of continue, stop; got 'retry'",
        2,
    ),
    "max_bad_steps of 0": (["--train.max_bad_steps=0"], "train.max_bad_steps must be positive, got 0", 2),
    "data directory that does not exist": (["--data.path={root}/nowhere"], "is not a directory", 2),
    "data directory that is not prepared": (["--data.path={root}/empty"], "not a prepared data directory", 2),
    "shard whose header lies about its length": (["--data.path={root}/lies"], "header says", 2),
    "shard with a wrong magic number": (["--data.path={root}/badmagic"], "not an llm.c/loom token shard", 2),
    "meta.json that is not JSON": (
        ["--data.path={root}/badmeta"],
        "cannot read '{root}/badmeta/meta.json'",
        2,
    ),
    "context longer than the data": (["--model.block_size=100000"], "larger than the", 2),
    "checkpoint from a different model shape": (
        ["--resume", "{root}/runs/ok", "--model.n_embd=64"],
        "was trained with another model shape: model.n_embd: 32 -> 64",
        2,
    ),
    "bit-flipped checkpoint named by --resume": (
        ["--resume", "{root}/runs/corrupt/ckpt/step_000002"],
        "__0_0.distcp' does not match its SHA-256 in the manifest",
        2,
    ),
    "--resume of a run with no valid checkpoint": (
        ["--resume", "{root}/runs/corrupt"],
        "no valid checkpoint",
        2,
    ),
    "--resume of a run that does not exist": (["--resume", "--run.name=none"], "does not exist", 2),
    "existing run with another config": (
        ["--run.name=ok", "--train.steps=5"],
        "already holds a run with a different config (train.steps: 2 -> 5)",
        2,
    ),
    "run name that climbs out of run.dir": (["--run.name=../../x"], "must be a plain folder name", 2),
    "train.resume=auto without a run name": (
        ["--train.resume=auto"],
        "train.resume=auto needs a run.name",
        2,
    ),
    "run directory without write permission": (["--run.dir={root}/ro", "--run.name=x"], "is not writable", 2),
}
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
MANY = 8 * CORES  # far above the cores this process may use
# Every other command (and train rows that need an exact command line): name -> (argv after `loom`, the
# message, the exit code). {root} is the tree, {many} and {cores} the process and core counts.
COMMANDS = {
    # preference pairs and loom dpo (issue 46)
    "data prepare --pairs: every pair's chosen equals its rejected": (
        ["data", "prepare", "--pairs", "--input", "{root}/same.jsonl", "--out", "{root}/cwd/p", "--tokenizer"]
        + ["char", "--block-size", "32"],
        "2 record(s): chosen equals rejected",
        2,
    ),
    "data prepare --pairs for a base run without chat tokens": (
        ["data", "prepare", "--pairs", "--input", "{root}/pairs.jsonl", "--out", "{root}/cwd/p"]
        + ["--tokenizer", "{root}/runs/ok", "--block-size", "32"],
        "'{root}/runs/ok' has no chat tokens: preference tuning starts from a chat model",
        2,
    ),
    "dpo: no model.init_from": (
        ["dpo", "--data.path={root}/pref"],
        "model.init_from is not set",
        2,
    ),
    "dpo: data that holds no pairs": (
        ["dpo", "--data.path={root}/data", "--model.init_from=run:{root}/runs/ok"],
        "loom dpo needs preference pairs; {root}/data holds no pairs",
        2,
    ),
    "dpo: unknown dpo.loss": (
        ["dpo", "--data.path={root}/pref", "--model.init_from=run:{root}/runs/ok", "--dpo.loss=hinge"],
        "config key 'dpo.loss' must be one of sigmoid, ipo; got 'hinge'",
        2,
    ),
    "train on pairs with an odd micro-batch": (
        ["train", "--data.path={root}/pref", "--train.micro_batch_size=1"],
        "train.micro_batch_size=1 rows: a micro-batch holds whole pairs",
        2,
    ),
    # data.mix (issue 47): each refused before any data is read or any model built
    "train: data.mix with a negative weight": (
        ["train", "--data.mix=a={root}/data:-0.5,b={root}/data:1"],
        "data.mix: the weight of 'a={root}/data' is negative (-0.5)",
        2,
    ),
    "train: data.mix whose weights sum to 0": (
        ["train", "--data.mix=a={root}/data:0"],
        "data.mix: the weights sum to 0.0",
        2,
    ),
    "train: data.mix naming an unknown source": (
        ["train", "--data.sources=web={root}/data", "--data.mix=web:0.7,code:0.3"],
        "data.mix: unknown source 'code' (not a name of data.sources, nor a folder)",
        2,
    ),
    "train: data.mix_schedule naming an unknown source": (
        ["train", "--data.mix=a={root}/data:1", "--data.mix_schedule=1@b:1"],
        "data.mix_schedule: unknown source 'b'",
        2,
    ),
    "train: data.mix of two vocabularies": (
        ["train", "--data.mix=a={root}/data:1,b={root}/othervocab:1"],
        "data.mix: 'b' has",
        2,
    ),
    "train: data.mix of two tokenizers": (
        ["train", "--data.mix=a={root}/data:1,b={root}/othertok:1"],
        "data.mix: 'b' ({root}/othertok) was prepared with another tokenizer than 'a'",
        2,
    ),
    "train: data.mix with doc masks and a source without end-of-text": (
        ["train", "--data.doc_mask=true", "--data.mix=a={root}/data:1,b={root}/noeot:1"],
        "data.doc_mask=true needs each source's end-of-text id; the meta of 'b' ({root}/noeot) gives none",
        2,
    ),
    # outputs that cannot be written: a folder this user may not write, or a path through a regular file
    "train: run.dir through a regular file": (
        ["train", "--run.dir={root}/afile/runs", "--run.name=x"],
        "'{root}/afile' is not a directory",
        2,
    ),
    "prepare: --out in a folder without write permission": (
        ["data", "prepare", "--input", "{root}/afile", "--out", "{root}/ro/x"],
        "--out '{root}/ro/x' is not writable",
        2,
    ),
    "prepare: --out through a regular file": (
        ["data", "prepare", "--input", "{root}/afile", "--out", "{root}/afile/x"],
        "'{root}/afile' is a file, not a directory",
        2,
    ),
    "convert: output folder without write permission": (
        ["data", "convert", "--to", "nanogpt", "{root}/data", "{root}/ro/x"],
        "output '{root}/ro/x' is not writable",
        2,
    ),
    "convert: output file through a regular file": (
        ["data", "convert", "--to", "llmc", "{root}/data/train_000000.bin", "{root}/afile/x.bin"],
        "'{root}/afile' is a file, not a directory",
        2,
    ),
    "export: --out in a folder without write permission": (
        ["export", "{root}/runs/ok", "--format", "hf", "--out", "{root}/ro/x"],
        "--out '{root}/ro/x' is not writable",
        2,
    ),
    "export: --out that is a regular file": (
        ["export", "{root}/runs/ok", "--format", "safetensors", "--out", "{root}/afile"],
        "--out '{root}/afile' is a file, not a directory",
        2,
    ),
    "export --format gguf of a family llama.cpp has no mapping for (before its checkpoint is read)": (
        ["export", "{root}/runs/moe", "--format", "gguf", "--out", "{root}/cwd/x"],
        "model.family=moe builds MoEGPT, which it has no mapping for",
        2,
    ),
    "export --gguf-type without --format gguf": (
        ["export", "{root}/runs/ok", "--format", "hf", "--gguf-type", "q8_0", "--out", "{root}/cwd/x"],
        "--gguf-type is an option of --format gguf, not --format hf",
        2,
    ),
    "plot: --out in a folder without write permission": (
        ["plot", "{root}/runs/ok", "--out", "{root}/ro/loss.png"],
        "--out '{root}/ro/loss.png' is not writable",
        2,
    ),
    "plot: --out through a regular file": (
        ["plot", "{root}/runs/ok", "--out", "{root}/afile/loss.png"],
        "'{root}/afile' is a file, not a directory",
        2,
    ),
    "plot: --out of a format matplotlib cannot write": (
        ["plot", "{root}/runs/ok", "--out", "{root}/cwd/loss.xyz"],
        "cannot write '.xyz' files",
        2,
    ),
    "verify: --out in a folder without write permission": (
        ["verify", "--strategies", "ddp", "--out", "{root}/ro/v"],
        "--out '{root}/ro/v' is not writable",
        2,
    ),
    "verify: --json through a regular file": (
        ["verify", "--strategies", "ddp", "--json", "{root}/afile/v.json"],
        "'{root}/afile' is a file, not a directory",
        2,
    ),
    "bench peak: --json in a folder without write permission": (
        ["bench", "peak", "--json", "{root}/ro/p.json"],
        "--json '{root}/ro/p.json' is not writable",
        2,
    ),
    "bench optim: --json through a regular file": (
        ["bench", "optim", "--params", "1M", "--json", "{root}/afile/o.json"],
        "'{root}/afile' is a file, not a directory",
        2,
    ),
    "bench train: --json in a folder without write permission": (
        ["bench", "train", "--synthetic", "--json", "{root}/ro/t.json"],
        "--json '{root}/ro/t.json' is not writable",
        2,
    ),
    "bench comm: --plot through a regular file": (
        ["bench", "comm", "--nproc", "2", "--plot", "{root}/afile/c.png"],
        "'{root}/afile' is a file, not a directory",
        2,
    ),
    # shapes that do not match
    # another run's checkpoint is refused as such before its shapes are compared (issue 42: one of the same
    # shapes was exported under this run's name); a config.toml edited away from its own checkpoint's shape is
    # test_config_vs_checkpoint's
    "export --ckpt of another run (of another shape too)": (
        [
            "export",
            "{root}/runs/ok",
            "--format",
            "safetensors",
            "--out",
            "{root}/cwd/x",
            "--ckpt",
            "{root}/runs/wide/ckpt/step_000001",
        ],
        "checkpoint '{root}/runs/wide/ckpt/step_000001' is not a checkpoint of the run '{root}/runs/ok'",
        2,
    ),
    "export --ckpt that is a file": (
        ["export", "{root}/runs/ok", "--format", "hf", "--out", "{root}/cwd/x", "--ckpt", "{root}/afile"],
        "checkpoint '{root}/afile' is not a directory",
        2,
    ),
    "prepare --tokenizer that does not exist (refused before reading the corpus)": (
        [
            "data",
            "prepare",
            "--input",
            "{root}/afile",
            "--out",
            "{root}/cwd/p",
            "--tokenizer",
            "{root}/nope.json",
        ],
        "--tokenizer '{root}/nope.json' is neither char, bpe nor an existing tokenizer file",
        2,
    ),
    # token dtypes
    "convert: unknown --dtype": (
        ["data", "convert", "--to", "llmc", "{root}/data", "{root}/cwd/x", "--dtype", "int7"],
        "--dtype 'int7' is not an integer token dtype",
        2,
    ),
    "convert: float --dtype": (
        ["data", "convert", "--to", "llmc", "{root}/data", "{root}/cwd/x", "--dtype", "float32"],
        "--dtype 'float32' is not an integer token dtype",
        2,
    ),
    # a meta.json whose vocabulary is smaller than the ids
    "train on a meta.json that claims fewer ids than the shards hold": (
        ["train", "--data.path={root}/smallvocab"],
        "outside the vocabulary of 5 ids",
        2,
    ),
    "eval --data with a meta.json that claims fewer ids": (
        ["eval", "{root}/runs/ok", "--data", "{root}/smallvocab"],
        "outside the vocabulary of 5 ids",
        2,
    ),
    # endless inputs
    "prepare --input /dev/zero": (
        ["data", "prepare", "--input", "/dev/zero", "--out", "{root}/cwd/z"],
        "--input '/dev/zero' is a device",
        2,
    ),
    "prepare --input a FIFO": (
        ["data", "prepare", "--input", "{root}/fifo", "--out", "{root}/cwd/z"],
        "--input '{root}/fifo' is a named pipe (FIFO)",
        2,
    ),
    "convert /dev/urandom": (
        ["data", "convert", "--to", "llmc", "/dev/urandom", "{root}/cwd/z"],
        "input '/dev/urandom' is a device",
        2,
    ),
    "inspect /dev/zero": (["data", "inspect", "/dev/zero"], "path '/dev/zero' is a device", 2),
    "train with /dev/zero as the config file": (
        ["train", "/dev/zero"],
        "config file '/dev/zero' is not a regular file",
        2,
    ),
    "hellaswag --data /dev/zero": (
        ["eval", "{root}/runs/ok", "--task", "hellaswag", "--data", "/dev/zero"],
        "HellaSwag file '/dev/zero' is not a regular file",
        2,
    ),
    "launch --hostfile /dev/zero": (
        ["launch", "--hostfile", "/dev/zero", "--dry-run", "--", "loom", "train"],
        "--hostfile '/dev/zero' is a device",
        2,
    ),
    # sampling options outside their domain
    "generate --temperature -1": (
        ["generate", "{root}/runs/ok", "--temperature", "-1"],
        "--temperature must be >= 0 (0: greedy), got -1.0",
        2,
    ),
    "generate --top-k 0": (
        ["generate", "{root}/runs/ok", "--top-k", "0"],
        "--top-k must be a positive number of tokens, got 0",
        2,
    ),
    "generate --top-k -5": (
        ["generate", "{root}/runs/ok", "--top-k", "-5"],
        "--top-k must be a positive number of tokens, got -5",
        2,
    ),
    "generate --top-p 0": (
        ["generate", "{root}/runs/ok", "--top-p", "0"],
        "--top-p must be in (0, 1], got 0.0",
        2,
    ),
    "generate --top-p 1.5": (
        ["generate", "{root}/runs/ok", "--top-p", "1.5"],
        "--top-p must be in (0, 1], got 1.5",
        2,
    ),
    "generate --max-new-tokens -1": (
        ["generate", "{root}/runs/ok", "--max-new-tokens", "-1"],
        "--max-new-tokens must be >= 0, got -1",
        2,
    ),
    "generate --num-samples 0": (
        ["generate", "{root}/runs/ok", "--num-samples", "0"],
        "--num-samples must be >= 1, got 0",
        2,
    ),
    "serve --max-seqs 0": (
        ["serve", "{root}/runs/ok", "--max-seqs", "0"],
        "--max-seqs must be at least 1, got 0",
        2,
    ),
    "serve --port 70000": (["serve", "{root}/runs/ok", "--port", "70000"], "--port must be in 0..65535", 2),
    "bench generate --batch 0": (["bench", "generate", "--batch", "0"], "need --batch sizes >= 1", 2),
    "bench generate --clients without a run": (
        ["bench", "generate", "--clients", "4"],
        "--clients serves a run",
        2,
    ),
    # zero or negative counts, never silently replaced by a default
    "eval --batches 0": (["eval", "{root}/runs/ok", "--batches", "0"], "--batches must be >= 1, got 0", 2),
    "eval --batches -1": (["eval", "{root}/runs/ok", "--batches", "-1"], "--batches must be >= 1, got -1", 2),
    "hellaswag --limit 0": (
        ["eval", "{root}/runs/ok", "--task", "hellaswag", "--data", "{root}/afile", "--limit", "0"],
        "--limit must be >= 1, got 0",
        2,
    ),
    "plan --seq-len 0": (
        ["plan", "--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--seq-len", "0"],
        "--seq-len must be positive, got 0",
        2,
    ),
    "plan --global-batch-tokens 0": (
        ["plan", "--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--global-batch-tokens", "0"],
        "--global-batch-tokens must be positive, got 0",
        2,
    ),
    "plan --mfu 2": (
        ["plan", "--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--mfu", "2"],
        "--mfu must be in (0, 1], got 2.0",
        2,
    ),
    "verify --nproc 0": (["verify", "--strategies", "ddp", "--nproc", "0"], "--nproc must be >= 1, got 0", 2),
    "verify --tol-loss -1": (
        ["verify", "--strategies", "ddp", "--tol-loss", "-1"],
        "--tol-loss must be >= 0, got -1.0",
        2,
    ),
    "inspect --sample-tokens -1": (
        ["data", "inspect", "{root}/data", "--sample-tokens", "-1"],
        "--sample-tokens must be >= 0 (0: no decoded sample), got -1",
        2,
    ),
    "convert --eot-id -1": (
        ["data", "convert", "--to", "megatron", "{root}/data", "{root}/cwd/m", "--eot-id", "-1"],
        "--eot-id must be a token id (>= 0), got -1",
        2,
    ),
    "bench peak --copy-mb 0": (["bench", "peak", "--copy-mb", "0"], "--copy-mb must be at least 1, got 0", 2),
    "bench optim --iters 0": (["bench", "optim", "--iters", "0"], "got --iters 0 --warmup 5", 2),
    "doctor --compile-timeout 0": (
        ["doctor", "--compile-timeout", "0"],
        "--compile-timeout must be > 0 seconds, got 0.0",
        2,
    ),
    # messages that must name the real cause
    "a bare number after --train.steps": (
        ["train", "--train.steps", "5", "--data.path={root}/data", "--run.dir={root}/runs"],
        "write --train.steps=5",
        2,
    ),
    "verify: a bare number after --model.n_layer": (
        ["verify", "--model.n_layer", "4"],
        "write --model.n_layer=4",
        2,
    ),
    "bench train: a bare number after --train.steps": (
        ["bench", "train", "--train.steps", "5", "--synthetic"],
        "write --train.steps=5",
        2,
    ),
    "generate --device on a GPU that is not there": (
        ["generate", "{root}/runs/ok", "--device", "cuda:999"],
        "--device cuda:999",
        2,
    ),
    "eval --device that is not a device": (
        ["eval", "{root}/runs/ok", "--device", "bogus"],
        "--device 'bogus' is not a device",
        2,
    ),
    "bench peak --device that is not a device": (
        ["bench", "peak", "--device", "bogus"],
        "--device 'bogus' is not a device",
        2,
    ),
    # --nproc far above the cores (warned, naming them; the bad data path then stops it before any process)
    "--nproc far above the core count": (
        ["train", "--nproc={many}", "--data.path={root}/nowhere"],
        "--nproc {many} starts {many} processes on the {cores} CPU core",
        2,
    ),
    # --resume of a run that already reached train.steps
    "--resume of a finished run": (
        ["train", "--resume", "{root}/runs/ok"],
        "already reached train.steps=2 (checkpoint 'step_000002' is at step 2)",
        2,
    ),
}


def _args(case: str, root: Path) -> list[str]:
    """`loom train` with the tiny model, the good data and the tree's run.dir, then the row's own settings
    (last: they win)."""
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


def _fill(text: str, root: Path) -> str:
    return text.format(root=root, many=MANY, cores=CORES)


def _row(case: str, root: Path) -> tuple[list[str], str, int]:
    """(argv after `loom`, expected message, expected exit code) of a row of either table."""
    if case in CASES:
        return _args(case, root), _fill(CASES[case][1], root), CASES[case][2]
    argv, message, code = COMMANDS[case]
    argv = [_fill(a, root) for a in argv]
    if argv[0] == "train" and argv[1:2] != ["/dev/zero"]:
        argv += (
            [*TINY, f"--run.dir={root / 'runs'}"]
            if not any(a.startswith("--run.dir") for a in argv)
            else TINY
        )
    return argv, _fill(message, root), code


@dataclass
class Result:
    argv: list[str]
    rc: int
    out: str
    err: str
    unchanged: bool  # every file of the tree, the data, the working directory and the cache as before


@pytest.fixture(scope="module")
def run_row(tree, char_data, tmp_path_factory):
    """Run a row once as `loom ...` in a process of its own (forked from one that imported loom and torch:
    faultkit.ForkServer), its cwd and LOOM_CACHE_DIR inside the hashed tree; later calls for the same row
    return the cached Result, so tests may run in any order or alone."""
    done: dict[str, Result] = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOOM_CACHE_DIR": str(tree / "cache")}
    server = ForkServer(tmp_path_factory.mktemp("rows"))

    def run(case: str) -> Result:
        if case not in done:
            argv, _, _ = _row(case, tree)
            before = (_tree_hash(tree), _tree_hash(char_data))
            rc, out, err = server.run(argv, tree / "cwd", env, timeout=120)
            unchanged = (_tree_hash(tree), _tree_hash(char_data)) == before
            done[case] = Result(argv, rc, out, err, unchanged)
        return done[case]

    yield run
    server.close()


ALL = [*CASES, *COMMANDS]


@pytest.mark.parametrize("case", ALL)
def test_bad_input(case, tree, run_row):
    _, message, code = _row(case, tree)
    r = run_row(case)
    said = r.out + r.err
    assert r.rc == code, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert r.err.count("loom: error:") == 1, said[-3000:]
    assert message in said, said[-3000:]
    assert r.unchanged, f"{r.argv} wrote, changed or deleted files"


def test_the_table(tree, run_row, tmp_path):
    """The markdown table of every row (printed with -s; written next to this test's temp files). Runs (or
    reuses) every row itself, so it passes or fails the same alone, first or last."""
    rows = []
    for case in ALL:
        r = run_row(case)
        first = r.err.split("loom: error: ", 1)[-1].splitlines()[0] if r.err else ""
        first = first.replace(str(tree), "…").replace("|", "\\|")
        rows.append(f"| {case} | {first} | {r.rc} |")
    table = "\n".join(["| input | message | exit code |", "|---|---|---|", *rows])
    out = tmp_path / "bad_input_table.md"
    out.write_text(table + "\n")
    print(f"\n{table}\n(written to {out})")
    assert len(rows) == len(CASES) + len(COMMANDS) >= 85
    assert all(row.endswith("| 2 |") for row in rows), table


def test_resume_auto_of_a_finished_run_warns(tree, tmp_path):
    """train.resume=auto (or an elastic restart) may start a job again after it finished: that is not an
    error, but it says that nothing is left to train and how to extend the run, instead of only 'resumed'."""
    shutil.copytree(tree / "runs" / "ok", tmp_path / "ok")
    argv = [
        "train",
        f"--run.dir={tmp_path}",
        "--run.name=ok",
        "--train.resume=auto",
        f"--data.path={tree / 'data'}",
        *TINY,
    ]
    p = subprocess.run(
        [sys.executable, "-m", "loom", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "already reached train.steps=2" in p.stdout and "--train.steps=4" in p.stdout, p.stdout
