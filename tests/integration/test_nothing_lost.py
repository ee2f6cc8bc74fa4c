"""Issue 14, items 1 and 2: nothing a user owns is deleted, and nothing wrong passes in silence.

Real CLI calls (`loom` as a command of its own, a warm fork: tests/loomrun.py), compared against
what the user expects: every refusal is one `loom: error:` with exit code 2 and every file left as it was;
every repair or doubt is named in the output. Each test failed on the code before the fix (7a12962)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from loomrun import loom_run
from tiny import tiny_args

TINY = tiny_args(
    {
        "model.n_layer": 1,
        "model.block_size": 16,
        "train.batch_size": 4,
        "train.eval_batches": 1,
        "optim.warmup_steps": None,
        "train.log_every": None,
        "train.eval_every": None,
    }
)
WORDS = "the of and to in is that it for as with was on be by at this from have or an they which one".split()


def loom(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return loom_run(*args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words)) + ".\n"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: what a refusal must leave exactly as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def refused(r: subprocess.CompletedProcess, *words: str) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "loom: error:" in r.stderr and "Traceback" not in out, out
    for w in words:
        assert w in out, (w, out)
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A prepared char data set and a run of 4 steps trained on it (tests copy what they may damage)."""
    root = tmp_path_factory.mktemp("made")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(text(400, i))
    r = loom("data", "prepare", "--input", corpus, "--out", root / "data", "--val-fraction", "0.3")
    assert r.returncode == 0, r.stdout + r.stderr
    r = loom(
        "train",
        f"--data.path={root / 'data'}",
        f"--run.dir={root / 'runs'}",
        "--run.name=r",
        "--train.steps=4",
        "--train.ckpt_every=4",
        *TINY,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- 1. data loss -----------------------------------------------------------------------------------------


def test_export_onto_its_own_run_is_refused(made, tmp_path):
    """`loom export RUN --out RUN --force` deleted the run (checkpoints, metrics, config) and exited 0."""
    run = copy(made / "runs" / "r", tmp_path / "runs" / "r")
    before = snapshot(tmp_path)
    refused(loom("export", run, "--format", "hf", "--out", run, "--force"), str(run))
    refused(loom("export", run, "--format", "safetensors", "--out", tmp_path / "runs", "--force"), "contains")
    assert snapshot(tmp_path) == before


def test_prepare_onto_its_input_is_refused(made, tmp_path):
    """`loom data prepare --input DIR --out DIR --force` deleted the corpus, files the glob skipped included."""
    corpus = copy(made / "corpus", tmp_path / "corpus")
    (corpus / "notes.md").write_text("not matched by the glob, and not to be deleted either")
    before = snapshot(tmp_path)
    refused(
        loom("data", "prepare", "--input", corpus, "--glob", "*.txt", "--out", corpus, "--force"), "input"
    )
    refused(loom("data", "prepare", "--input", corpus / "doc0.txt", "--out", tmp_path, "--force"), "contains")
    refused(loom("data", "prepare", "--input", corpus, "--out", corpus / "prepared"), "lies inside")
    assert snapshot(tmp_path) == before


def test_force_replaces_only_what_loom_wrote(made, tmp_path):
    """--force deleted any folder it was given; now only loom's own output of the same kind (marked with
    .loom-output, or from before the marker: recognised by its contents) is replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("three years of work")
    data = copy(made / "data", tmp_path / "data")
    run = copy(made / "runs" / "r", tmp_path / "runs" / "r")
    corpus = made / "corpus"
    before = snapshot(tmp_path)
    refused(loom("data", "prepare", "--input", corpus, "--out", mine, "--force"), "not a folder loom wrote")
    refused(
        loom(
            "train",
            f"--data.path={data}",
            f"--run.dir={tmp_path}",
            "--run.name=mine",
            "--force",
            "--train.steps=1",
            *TINY,
        ),
        "not a folder loom wrote",
    )
    refused(loom("export", run, "--format", "hf", "--out", mine, "--force"), "not a folder loom wrote")
    refused(loom("export", run, "--format", "hf", "--out", data, "--force"), "prepared data set")
    refused(loom("data", "prepare", "--input", corpus, "--out", run, "--force"), "training run")
    assert snapshot(tmp_path) == before
    # loom's own outputs are still replaced: a marked data set, and one from before the marker existed
    assert loom("data", "prepare", "--input", corpus, "--out", data, "--force").returncode == 0
    assert json.loads((data / ".loom-output").read_text())["kind"] == "data"
    (data / ".loom-output").unlink()
    r = loom("data", "prepare", "--input", corpus, "--out", data, "--force", "--seed", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((data / "meta.json").read_text())["seed"] == 2


def test_consolidate_never_writes_over_a_run(made, tmp_path):
    """Issue 27 item 2: `loom ckpt consolidate RUN --out OTHER_RUN --force` replaced the other run's config.toml,
    run.json and tokenizer/ (exit 0; that run then refused to resume). A run is never consolidate's output, and
    --force replaces only a folder consolidate wrote (outputs.py's rule, as every other --force)."""
    run = copy(made / "runs" / "r", tmp_path / "runs" / "r")
    other = copy(made / "runs" / "r", tmp_path / "runs" / "other")
    info = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**info, "note": "the other run's own record"}))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not loom's")
    before = snapshot(tmp_path)
    for force in ([], ["--force"]):
        out = refused(loom("ckpt", "consolidate", run, "--out", other, *force), "is a training run", "never")
        assert "hint: give a new folder" in out
    refused(loom("ckpt", "consolidate", run, "--out", run, "--force"), "is the input")
    refused(loom("ckpt", "consolidate", run, "--out", mine, "--force"), "not a folder loom wrote")
    assert snapshot(tmp_path) == before
    # its own output: refused without --force, replaced with it (marked, or from before the marker existed)
    cons = tmp_path / "cons"
    assert loom("ckpt", "consolidate", run, "--out", cons).returncode == 0
    assert json.loads((cons / ".loom-output").read_text())["kind"] == "consolidated"
    refused(loom("ckpt", "consolidate", run, "--out", cons), "not empty", "--force")
    assert loom("ckpt", "consolidate", run, "--out", cons, "--force").returncode == 0
    (cons / ".loom-output").unlink()
    r = loom("ckpt", "consolidate", run, "--out", cons, "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in cons.iterdir()) == [
        ".loom-output",
        "config.toml",
        "model.safetensors",
        "run.json",
        "tokenizer",
    ]


# --- 2. silent wrong results ------------------------------------------------------------------------------


def test_inputs_are_read_once_and_repeated_documents_are_counted(tmp_path):
    """The same file twice, or a folder plus a file inside it, was read twice: val became a copy of train."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(text(300, i))
    (corpus / "copy_of_doc0.txt").write_text(text(300, 0))  # the same text under another name
    r = loom(
        "data",
        "prepare",
        "--input",
        corpus,
        corpus / "doc1.txt",
        corpus / "doc1.txt",
        "--out",
        tmp_path / "out",
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    splits = json.loads((tmp_path / "out" / "meta.json").read_text())["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 5  # each file once
    assert "read once" in out and "doc1.txt" in out
    assert "1 document(s) repeat" in out


def test_data_with_another_tokenizer_of_the_same_size_is_refused(made, tmp_path):
    """Two char vocabularies of the same size: `eval --data` and `train --resume` accepted the other one, and
    resume overwrote the run's tokenizer/, so its earlier checkpoints decoded wrongly."""
    run = copy(made / "runs" / "r", tmp_path / "runs" / "r")
    upper = tmp_path / "upper"
    upper.mkdir()
    for p in sorted((made / "corpus").iterdir()):  # the same text in capitals: as many characters, others
        (upper / p.name).write_text(p.read_text().upper())
    other = tmp_path / "other"
    assert loom("data", "prepare", "--input", upper, "--out", other, "--val-fraction", "0.3").returncode == 0
    vocab = [json.loads((d / "meta.json").read_text())["vocab_size"] for d in (made / "data", other)]
    assert vocab[0] == vocab[1]
    before = snapshot(run)
    refused(
        loom("eval", run, "--data", other, "--device", "cpu"),
        "character vocabularies differ",
        "only the data's has 'A'",
    )
    refused(loom("train", "--resume", run, f"--data.path={other}", "--train.steps=6"), "vocabularies differ")
    assert snapshot(run) == before  # the run's tokenizer/ is untouched
    # the same tokenizer is accepted, also for a data set prepared before meta.json held its hash
    same = copy(made / "data", tmp_path / "same")
    meta = json.loads((same / "meta.json").read_text())
    meta["tokenizer"].pop("sha256", None)
    (same / "meta.json").write_text(json.dumps(meta))
    r = loom("eval", run, "--data", same, "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr


def test_nproc_with_mpi_is_refused_before_anything_starts(made, tmp_path):
    """`--nproc 2 --parallel.dp_impl=mpi` ran two separate 1-process trainings into one run folder."""
    r = loom(
        "train",
        "--nproc",
        "2",
        "--parallel.dp_impl=mpi",
        f"--data.path={made / 'data'}",
        f"--run.dir={tmp_path}",
        "--run.name=m",
        "--train.steps=2",
        *TINY,
        timeout=120,
    )
    refused(r, "mpiexec -n 2")
    assert not (tmp_path / "m").exists()


def test_docs_split_gives_val_its_share_of_the_text(tmp_path):
    """Choosing documents by count sent 40-70% of the text to val when a few documents are large."""
    from loom.data.prepare import split_documents

    sizes = [3000, 2500, 2000, 1000, 800, 500, 400, 300, 200, 100]
    texts = ["x" * n for n in sizes]
    for seed in range(20):
        train, val = split_documents(texts, 0.1, "docs", seed)
        share = sum(map(len, val)) / sum(sizes)
        assert abs(share - 0.1) < 0.03, (seed, share)
        assert train and val and sorted(train + val) == sorted(texts)
    # when whole documents cannot come close, the summary says so with the share val got
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.txt").write_text(text(2000, 1))
    (corpus / "small.txt").write_text(text(20, 2))
    r = loom("data", "prepare", "--input", corpus, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "val holds" in r.stdout and "of the tokens" in r.stdout


def test_dropped_documents_are_counted_and_named(tmp_path):
    """A JSONL text that is a number, null, a list or empty, and undecodable bytes, were dropped or replaced
    without a word; the summary now counts them and names the first few."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [
        {"text": text(200, 1)},
        {"text": 5},
        {"text": None},
        {"text": ["a", "b"]},
        {"text": text(200, 2)},
        {"text": ""},
        {"text": text(200, 3)},
    ]
    (corpus / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (corpus / "latin1.txt").write_bytes(text(100, 4).encode() + b"caf\xe9\n")
    r = loom("data", "prepare", "--input", corpus, "--out", tmp_path / "out")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "dropped 4 document(s)" in out
    for where in (
        "records.jsonl:2 ('text' is a number)",
        "records.jsonl:3 ('text' is null)",
        "records.jsonl:4 ('text' is a list)",
        "records.jsonl:6 ('text' is empty)",
    ):
        assert where in out, (where, out)
    assert "latin1.txt" in out  # named where its bytes were replaced
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["dropped_documents"] == 4
