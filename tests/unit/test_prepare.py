"""`loom data prepare`, reading documents, splitting and the built-in corpus.

Compared against: the input text itself (every prepared shard, decoded with the saved tokenizer, must give
back the documents, each preceded by the end-of-text id as llm.c's data scripts do), and nanoGPT's
`data[:int(n*0.9)]` / `data[int(n*0.9):]` train/val cut for a single document.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import loom
from loom.data import corpus
from loom.data.corpus import corpus_files, python_stdlib_files
from loom.data.prepare import prepare, split_documents
from loom.data.shards import read_header, read_shard
from loom.data.sources import ReadOptions, ReadStats, input_files, iter_units
from loom.data.tokenizers import EOT, CharTokenizer, load_tokenizer, tokenizer_hash
from loom.errors import LoomError

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "naïve café — ünïcode ✓ and emoji 🙂\n",
    "x = [i * i for i in range(10)]\nprint(x)\n",
    "Line one.\nLine two.\n\nLine four after a blank.\n",
]


def write_docs(folder: Path, docs=DOCS, suffix=".txt") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, d in enumerate(docs):
        (folder / f"doc{i}{suffix}").write_text(d, encoding="utf-8")
    return folder


def split_tokens(out: Path, split: str) -> np.ndarray:
    paths = sorted(out.glob(f"{split}_*.bin"))
    return np.concatenate([np.asarray(read_shard(p), dtype=np.int64) for p in paths])


def documents(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    """Cut a split at its end-of-text ids; the split must start with one."""
    assert tokens[0] == eot
    cuts = np.flatnonzero(tokens == eot)
    return [tokens[a + 1 : b] for a, b in zip(cuts, [*cuts[1:], len(tokens)], strict=True)]


def load(out: Path):
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    return meta, load_tokenizer(out, meta)


# --- tokenizers through prepare -------------------------------------------------------------------------


def test_char_round_trip_and_eot_between_documents(tmp_path):
    out = tmp_path / "out"
    prepare([write_docs(tmp_path / "in")], out, tokenizer="char", val_fraction=0.4, seed=0)
    meta, tok = load(out)
    assert isinstance(tok, CharTokenizer)
    assert meta["tokenizer"]["eot_id"] == tok.eot_id == tok.vocab_size - 1
    assert tok.vocab_size == len(set("".join(DOCS))) + 1
    for d in DOCS:
        assert tok.decode(tok.encode(d)) == d
    got = []
    for split in ("train", "val"):
        docs = [tok.decode(d.tolist()) for d in documents(split_tokens(out, split), tok.eot_id)]
        assert len(docs) == meta["splits"][split]["documents"]
        got += docs
    assert sorted(got) == sorted(DOCS)  # every document once, whole, in one split


def test_bpe_trained_here_saves_and_reloads(tmp_path):
    docs = [f"def f{i}(x):\n    return x * {i} + {i * i}  # naïve\n" for i in range(40)]
    out = tmp_path / "out"
    meta = prepare([write_docs(tmp_path / "in", docs)], out, tokenizer="bpe", vocab_size=300, seed=0)
    assert meta["tokenizer"]["kind"] == "bpe"
    assert meta["tokenizer"]["file"] == "tokenizer.json"
    assert (out / "tokenizer.json").is_file()
    assert 258 <= meta["vocab_size"] <= 300
    _, tok = load(out)
    assert tok.tok.token_to_id(EOT) == tok.eot_id == meta["tokenizer"]["eot_id"]
    assert tok.vocab_size == meta["vocab_size"]
    got = []
    for split in ("train", "val"):
        tokens = split_tokens(out, split)
        assert int(tokens.max()) < meta["vocab_size"]
        got += [tok.decode(d.tolist()) for d in documents(tokens, tok.eot_id)]
    assert sorted(got) == sorted(docs)
    # Merges were learned: the tokens are fewer than the bytes.
    assert meta["splits"]["train"]["tokens"] < sum(len(d.encode()) for d in docs)


def test_existing_tokenizer_json(tmp_path):
    first = tmp_path / "first"
    corpus = [f"alpha beta gamma {i}\n" for i in range(30)]
    prepare([write_docs(tmp_path / "in", corpus)], first, tokenizer="bpe", vocab_size=300, seed=0)
    other = ["gamma beta alpha 7\n", "beta beta 12\n", "alpha 99\n"]
    inp = write_docs(tmp_path / "in2", other)
    for i, spec in enumerate([first / "tokenizer.json", first]):  # the file or the folder holding it
        out = tmp_path / f"second{i}"
        meta = prepare([inp], out, tokenizer=str(spec), seed=0)
        assert meta["tokenizer"]["kind"] == "tokenizer.json"
        assert meta["tokenizer"]["file"] == "tokenizer.json"
        assert (out / "tokenizer.json").read_text() == (first / "tokenizer.json").read_text()
        _, tok = load(out)
        got = [
            tok.decode(d.tolist())
            for s in ("train", "val")
            for d in documents(split_tokens(out, s), tok.eot_id)
        ]
        assert sorted(got) == sorted(other)


def test_tokenizer_spec_that_is_nothing(tmp_path):
    with pytest.raises(LoomError, match="neither char, bpe nor an existing tokenizer file"):
        prepare([write_docs(tmp_path / "in")], tmp_path / "out", tokenizer=str(tmp_path / "nope.json"))
    assert not (tmp_path / "out").exists()


def test_bpe_vocab_too_small_fails_before_reading(tmp_path):
    # The input does not exist: the vocab-size error must come first, before any input is read.
    with pytest.raises(LoomError, match="too small") as e:
        prepare([tmp_path / "missing.txt"], tmp_path / "out", tokenizer="bpe", vocab_size=257)
    assert e.value.hint and "258" in e.value.hint
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "option,value,message",
    [
        (
            "--tokenizer-sample",
            "0",
            "--tokenizer-sample must be >= 1 (characters of train text the BPE is trained on), got 0",
        ),
        ("--doc-cap", "0", "--doc-cap must be >= 1 (characters of one document in the BPE's sample), got 0"),
        ("--doc-cap", "-5", "--doc-cap must be >= 1"),
        ("--workers", "-1", "--workers must be >= 0 (encoding processes), got -1"),
        (
            "--doc-chars",
            "-1",
            "--doc-chars must be >= 0 (characters per document cut from a text file), got -1",
        ),
        ("--seed", "-1", "--seed must be >= 0"),
        ("--vocab-size", "-3", "--vocab-size must be >= 1"),
        ("--shard-tokens", "0", "--shard-tokens must be >= 1 (tokens per shard), got 0"),
    ],
)
def test_counts_outside_their_domain_are_refused_before_reading(tmp_path, capsys, option, value, message):
    """A BPE trained on 0 characters, negative workers or document sizes: refused, one error naming the
    option, before the (missing) input is read."""
    from loom.cli import main

    out = tmp_path / "out"
    argv = [
        "data",
        "prepare",
        "--input",
        str(tmp_path / "missing.txt"),
        "--out",
        str(out),
        "--tokenizer",
        "bpe",
    ]
    assert main([*argv, option, value]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("loom: error:") == 1, err
    assert not out.exists()


def test_a_bpe_sample_that_took_nothing_is_refused(tmp_path):
    with pytest.raises(LoomError, match="the BPE's training sample is empty") as e:
        prepare(
            [write_docs(tmp_path / "in")],
            tmp_path / "out",
            tokenizer="bpe",
            vocab_size=300,
            tokenizer_sample=1,
        )
    assert "--tokenizer-sample" in e.value.hint
    assert not (tmp_path / "out").exists()


# --- reading documents ----------------------------------------------------------------------------------


def streamed(inputs, glob: str = "*", jsonl_field: str = "text", strict: bool = False):
    """(whole documents, ReadStats) as `loom data prepare` reads them: loom.data.sources' input_files and
    iter_units, the pieces of a document joined back."""
    stats, texts = ReadStats(), []
    opts = ReadOptions(glob=glob, field=jsonl_field, strict=strict)
    for u in iter_units(input_files(inputs, glob, stats), opts, stats):
        if u.new_doc:
            texts.append(u.text)
        else:
            texts[-1] += u.text
    return texts, stats


def test_jsonl_named_field(tmp_path):
    path = tmp_path / "d.jsonl"
    recs = [{"body": "first doc", "id": 1}, {"body": "second doc"}, {"body": ""}, {"body": "third"}]
    path.write_text(
        "\n".join(json.dumps(r) for r in recs[:2]) + "\n\n" + "\n".join(json.dumps(r) for r in recs[2:])
    )
    texts, _ = streamed([path], jsonl_field="body")
    assert texts == ["first doc", "second doc", "third"]  # blank lines and empty texts dropped
    out = tmp_path / "out"
    meta = prepare([path], out, jsonl_field="body", seed=0)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 3


def test_jsonl_missing_field_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"content": "c"}\n')
    with pytest.raises(LoomError, match=r"d\.jsonl:3 has no field 'text'"):
        streamed([path], strict=True)
    with pytest.raises(LoomError, match="no field 'body'") as e:
        streamed([path], jsonl_field="body", strict=True)
    assert "--jsonl-field" in e.value.hint
    texts, stats = streamed([path])  # without --strict: counted, named and skipped
    assert texts == ["a", "b"]
    assert stats.bad_lines_count == 1 and "d.jsonl:3" in stats.bad_lines[0]


def test_jsonl_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n{"text": oops}\n')
    with pytest.raises(LoomError, match=r"d\.jsonl:2 is not valid JSON"):
        streamed([path], strict=True)
    assert streamed([path])[1].bad_lines_count == 1


def _write_input(tmp_path, name: str):
    """An input whose text cannot be found for one reason the user can fix (see the table below)."""
    lines = '{"body": "first doc", "id": 1}\n{"body": "second doc", "id": 2}\n'
    path = tmp_path / name
    if name.endswith(".parquet"):
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        cols = (
            {"text": [1, 2]} if name == "ints.parquet" else {"meta": [{"text": "hi there"}, {"text": "yo"}]}
        )
        pq.write_table(pa.table({**cols, "body": ["first doc", "second doc"]}), path)
    elif name == "nested.jsonl":
        path.write_text('{"meta": {"text": "first doc"}}\n{"meta": {"text": "second doc"}}\n')
    elif name == "empty.jsonl":
        path.write_text('{"text": ""}\n{"text": null}\n')
    else:  # plain JSONL, under any name (a .gz / .zst that is not compressed)
        path.write_text(lines)
    return path


@pytest.mark.parametrize(
    "name,field,message,hint",
    [
        (
            "nofield.jsonl",
            "text",
            r"none of the 2 JSON line\(s\) of .* has the field 'text' \(the first line's "
            r"fields: body, id\)",
            "text under: body",
        ),
        ("plain.jsonl.gz", "body", "is not gzip-compressed", "name a plain JSONL file .jsonl"),
        ("plain.jsonl.zst", "body", "is not zstandard-compressed", "name a plain JSONL file .jsonl"),
        ("ints.parquet", "text", "column 'text' of .* holds int64, not text", "--jsonl-field: body"),
        ("nested.parquet", "text", "has no column 'text'", "--jsonl-field: meta.text, body"),
        ("nested.jsonl", "meta", "has text under 'meta': it holds an object", "--jsonl-field: meta.text"),
        (
            "empty.jsonl",
            "text",
            r"corpus is empty.*2 document\(s\) with no text: .*empty.jsonl:1 \('text' is "
            r"empty\), .*empty.jsonl:2 \('text' is null\)",
            "--input",
        ),
    ],
)
def test_an_empty_corpus_names_the_real_cause(tmp_path, name, field, message, hint):
    """The cause behind "the corpus is empty" is named, with the option that fixes it (a field missing from
    every line was an error before streaming; it had become an empty corpus)."""
    path = _write_input(tmp_path, name)
    with pytest.raises(LoomError, match=message) as e:
        prepare([path], tmp_path / "out", jsonl_field=field)
    assert hint in e.value.hint
    with pytest.raises(LoomError):  # --strict: the same, or the first bad line named
        prepare([path], tmp_path / "out", jsonl_field=field, strict=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["nested.jsonl", "nested.parquet"])
def test_a_dotted_field_reaches_into_objects(tmp_path, name):
    path = _write_input(tmp_path, name)
    want = ["first doc", "second doc"] if name.endswith(".jsonl") else ["hi there", "yo"]
    assert streamed([path], jsonl_field="meta.text")[0] == want


def test_folder_recursive_glob_skips_hidden(tmp_path):
    root = tmp_path / "src"
    files = {
        "a.py": "A = 1\n",
        "pkg/b.py": "B = 2\n",
        "pkg/deep/c.py": "C = 3\n",
        "pkg/notes.txt": "not python\n",
        "README.md": "# readme\n",
        ".hidden/d.py": "D = 4\n",
        "pkg/.cache/e.py": "E = 5\n",
        "pkg/.f.py": "F = 6\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    texts, stats = streamed([root], glob="*.py")
    assert texts == ["A = 1\n", "B = 2\n", "C = 3\n"]
    assert stats.files == 3
    everything, _ = streamed([root])
    assert sorted(everything) == sorted(["A = 1\n", "B = 2\n", "C = 3\n", "not python\n", "# readme\n"])


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    (root / "bad.txt").write_bytes(b"caf\xe9 latin-1 \xff\xfe text\n")
    (root / "good.txt").write_text("plain text\n")
    (root / "literal.txt").write_text("a real \ufffd replacement char\n")  # valid UTF-8: not counted
    texts, stats = streamed([root])
    assert stats.replaced_files == 1
    assert stats.files == 3
    assert "caf\ufffd latin-1" in texts[0]
    meta = prepare([root], tmp_path / "out", seed=0)
    assert meta["replaced_files"] == 1
    assert meta["files"] == 3


def test_undecodable_bytes_counted_beside_a_literal_replacement_char(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes("ok \ufffd ".encode() + b"\xff bad\n")
    assert streamed([path])[1].replaced_files == 1


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_jsonl_lone_surrogate_is_handled(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ab\\ud800cd"}\n' + "".join(f'{{"text": "doc {i}"}}\n' for i in range(9)))
    out = tmp_path / "out"
    try:
        prepare([path], out, tokenizer=tokenizer, vocab_size=300, seed=0)
    except LoomError:
        assert not out.exists()
    else:
        assert (out / "meta.json").is_file()
    assert not (tmp_path / ".out.loom-tmp").exists()


def test_binary_explicit_input_is_an_error(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x7fELF\x00\x00\x01" * 20)
    with pytest.raises(LoomError, match="looks binary"):
        streamed([path])
    with pytest.raises(LoomError, match="looks binary"):
        prepare([path], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_binary_files_in_folder_are_skipped_and_counted(tmp_path):
    root = write_docs(tmp_path / "in", DOCS[:3])
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    texts, stats = streamed([root])
    assert len(texts) == 3
    assert stats.skipped_binary == [str(root / "image.png")]
    meta = prepare([root], tmp_path / "out", seed=0)
    assert meta["skipped_binary"] == 1
    assert meta["files"] == 3


def test_folder_of_only_binary_files_is_empty(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    (root / "a.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(LoomError, match=r"corpus is empty.*1 binary files skipped"):
        prepare([root], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_input(tmp_path):
    with pytest.raises(LoomError, match="does not exist") as e:
        streamed([write_docs(tmp_path / "in"), tmp_path / "nope.txt"])
    assert "nope.txt" in str(e.value)
    with pytest.raises(LoomError, match="does not exist"):
        prepare([tmp_path / "nope.txt"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_empty_corpus(tmp_path):
    empty_file = tmp_path / "empty.txt"
    empty_file.write_text("")
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    for inp in (empty_file, empty_dir):
        with pytest.raises(LoomError, match="corpus is empty"):
            prepare([inp], tmp_path / "out")
        assert not (tmp_path / "out").exists()
    with pytest.raises(LoomError, match="corpus is empty"):
        prepare([write_docs(tmp_path / "py", DOCS[:2])], tmp_path / "out", glob="*.py")  # nothing matches


# --- splitting ------------------------------------------------------------------------------------------


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefgh ij\nkl") for _ in range(n))


@pytest.mark.parametrize("split_mode", ["tail", "docs"])  # docs falls back to tail for one document
def test_single_document_split_is_nanogpts(tmp_path, split_mode):
    data = _text(1003)
    n = len(data)
    (tmp_path / "input.txt").write_text(data)
    out = tmp_path / "out"
    meta = prepare([tmp_path / "input.txt"], out, split_mode=split_mode, val_fraction=0.1)
    _, tok = load(out)
    train, val = split_tokens(out, "train"), split_tokens(out, "val")
    assert train[0] == val[0] == tok.eot_id
    assert tok.decode(train[1:].tolist()) == data[: int(n * 0.9)]
    assert tok.decode(val[1:].tolist()) == data[int(n * 0.9) :]
    assert meta["splits"]["train"]["tokens"] == int(n * 0.9) + 1
    assert meta["splits"]["val"]["tokens"] == n - int(n * 0.9) + 1


def test_tail_split_across_documents():
    train, val = split_documents(["aaaa", "bbbbbb", "cc"], 0.5, "tail", seed=0)
    assert train == ["aaaa", "bb"]  # cut at int(12 * 0.5) = 6 characters, inside the second document
    assert val == ["bbbb", "cc"]
    train, val = split_documents(["aaaa", "bbbbbb"], 0.6, "tail", seed=0)  # cut falls on the boundary
    assert train == ["aaaa"] and val == ["bbbbbb"]


def test_docs_split_is_seeded():
    texts = [f"document {i}" for i in range(20)]
    a = split_documents(texts, 0.25, "docs", seed=1)
    assert a == split_documents(texts, 0.25, "docs", seed=1)
    assert a[1] != split_documents(texts, 0.25, "docs", seed=2)[1]
    train, val = a
    assert len(val) == 5
    assert sorted(train + val) == sorted(texts)
    assert not set(train) & set(val)
    assert train == [t for t in texts if t in train]  # document order is kept within a split


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("val_fraction", [0.01, 0.1, 0.5, 0.99])
def test_docs_split_of_two_documents_has_both_splits(seed, val_fraction):
    train, val = split_documents(["one", "two"], val_fraction, "docs", seed)
    assert len(train) == len(val) == 1
    assert sorted(train + val) == ["one", "two"]


def test_split_errors():
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(LoomError, match="val-fraction"):
            split_documents(["a", "b"], bad, "docs", 0)
    with pytest.raises(LoomError, match="unknown --split-mode"):
        split_documents(["a", "b"], 0.1, "random", 0)
    with pytest.raises(LoomError, match="too small"):
        split_documents(["a"], 0.1, "tail", 0)  # int(1 * 0.9) = 0 characters for train
    assert split_documents(["abc"], 0.1, "tail", 0) == (["ab"], ["c"])


# --- output directory and meta.json ---------------------------------------------------------------------


def test_existing_out_is_refused_without_force(tmp_path):
    inp = write_docs(tmp_path / "in")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(LoomError, match="already exists") as e:
        prepare([inp], out)
    assert "--force" in e.value.hint
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"

    with pytest.raises(LoomError, match="not a folder loom wrote"):  # --force replaces only loom's output
        prepare([inp], out, force=True)
    assert (out / "keep.txt").read_text() == "precious"
    (out / "keep.txt").unlink()
    prepare([inp], out)
    prepare([inp], out, force=True)  # a data set loom wrote is replaced
    assert (out / "meta.json").is_file()
    assert not (tmp_path / ".out.loom-tmp").exists()


def test_out_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "out"
    out.write_text("precious")
    with pytest.raises(LoomError, match="out"):
        prepare([write_docs(tmp_path / "in")], out)
    assert out.read_text() == "precious"


def test_existing_empty_out_is_used(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    prepare([write_docs(tmp_path / "in")], out)
    assert (out / "meta.json").is_file()


def test_meta_fields(tmp_path):
    inp = write_docs(tmp_path / "in")
    out = tmp_path / "out"
    meta = prepare([inp], out, val_fraction=0.4, seed=3)
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["format"] == "llm.c"
    assert meta["loom_version"] == loom.__version__
    assert meta["tokenizer"] == {
        "kind": "char",
        "file": "char_vocab.json",
        "eot_id": meta["vocab_size"] - 1,
        "sha256": tokenizer_hash(out, meta),
    }
    assert meta["vocab_size"] == len(set("".join(DOCS))) + 1
    assert meta["shard_version"] == 1
    assert meta["files"] == len(DOCS)
    assert meta["replaced_files"] == meta["skipped_binary"] == 0
    assert (meta["val_fraction"], meta["split_mode"], meta["seed"]) == (0.4, "docs", 3)
    assert meta["source"] == str(inp)
    assert meta["splits"]["train"]["documents"] == 3
    assert meta["splits"]["val"]["documents"] == 2
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert info["shards"] == 1
        assert read_header(out / f"{split}_000000.bin") == (1, info["tokens"])
    total_chars = sum(len(d) for d in DOCS)
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == total_chars + len(DOCS)


def test_small_shards_hold_the_same_tokens(tmp_path):
    inp = write_docs(tmp_path / "in")
    one, many = tmp_path / "one", tmp_path / "many"
    prepare([inp], one, seed=0)
    meta = prepare([inp], many, seed=0, shard_tokens=16)
    for split in ("train", "val"):
        n = meta["splits"][split]["tokens"]
        assert meta["splits"][split]["shards"] == -(-n // 16)
        assert len(list(many.glob(f"{split}_*.bin"))) == meta["splits"][split]["shards"]
        assert np.array_equal(split_tokens(many, split), split_tokens(one, split))


def test_parallel_char_encoding_matches_serial(tmp_path):
    """prepare's chunks (chunk_chars) encoded by a pool of worker processes give the ids of one process, and
    each document's ids are its characters' after an end-of-text."""
    texts = [_text(1000, s) * 60 for s in range(3)]  # 3 x 60k chars -> chunks of 2 and 1 documents
    inp = write_docs(tmp_path / "in", texts)
    kw = dict(tokenizer="char", val_fraction=0.34, seed=0, chunk_chars=100_000)
    serial = prepare([inp], tmp_path / "one", workers=1, **kw)
    pooled = prepare([inp], tmp_path / "two", workers=2, **kw)
    assert serial["splits"] == pooled["splits"]
    _, tok = load(tmp_path / "two")
    got = []
    for split in ("train", "val"):
        ids = split_tokens(tmp_path / "two", split)
        assert np.array_equal(ids, split_tokens(tmp_path / "one", split))
        got += [tok.decode(d.tolist()) for d in documents(ids, tok.eot_id)]
    assert sorted(got) == sorted(texts)


# --- built-in corpus ------------------------------------------------------------------------------------


def test_python_stdlib_files():
    files = python_stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 100
    assert files == sorted(files)
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    for f in files:
        assert not {"test", "tests", "site-packages"} & set(f.relative_to(root).parts[:-1]), f
    names = {f.relative_to(root).as_posix() for f in files}
    assert {"os.py", "json/__init__.py"} <= names


def test_corpus_with_no_files(monkeypatch):
    monkeypatch.setitem(corpus.CORPORA, "python-stdlib", lambda: [])
    with pytest.raises(LoomError, match="found no files"):
        corpus_files("python-stdlib")


def test_unknown_corpus():
    with pytest.raises(LoomError, match="unknown built-in corpus") as e:
        corpus_files("shakespeare")
    assert "python-stdlib" in e.value.hint


def test_the_built_in_corpus_needs_no_warning_and_users_data_keeps_them(tmp_path, monkeypatch, capsys):
    """`make demo` warned about loom's own corpus: empty __init__.py files dropped, repeated documents (which
    make the val loss too low). The built-in corpus leaves them out before the split, under a new cache key
    (a cache prepared by an older loom is prepared again); the same files given as --input still warn."""
    from loom.config import Config
    from loom.train.setup import resolve_data

    root = tmp_path / "stdlib"
    for name, text in {
        "os.py": "import sys\n",
        "json/__init__.py": "from .decoder import x\n",
        "json/decoder.py": "x = 1\n" * 50,
        "email/mime/__init__.py": "",
        "urllib/__init__.py": "",
        "__phello__/spam.py": "print('hi')\n",
        "__phello__/__init__.py": "print('hi')\n",
        "xmlrpc/__init__.py": "# a package\n",
        "concurrent/__init__.py": "# a package\n",
        "test/test_os.py": "assert 1\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    names = [f.relative_to(root).as_posix() for f in python_stdlib_files()]
    assert names == [
        "__phello__/__init__.py",
        "concurrent/__init__.py",
        "json/__init__.py",
        "json/decoder.py",
        "os.py",
    ]
    cache = tmp_path / "cache"
    old = cache / "data" / "python-stdlib-char"  # what an older loom prepared: not used
    old.mkdir(parents=True)
    (old / "meta.json").write_text("{}")
    capsys.readouterr()
    cfg = Config()
    cfg.data.cache_dir = str(cache)
    out = resolve_data(cfg)
    said = capsys.readouterr().out
    assert out != old and out.name.startswith(corpus.cache_name("python-stdlib")), out
    assert "with no text" not in said and "repeat the text" not in said, (
        said
    )  # (5 files: too few to split evenly)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 5 and meta["dropped_documents"] == 0 and meta["repeated_documents"] == 0
    prepare([root], tmp_path / "users", val_fraction=0.3)  # the same files as a user's input: warned about
    said = capsys.readouterr().out
    assert (
        "dropped 2 document(s) with no text" in said
        and "2 document(s) repeat the text of an earlier one" in said
    )


def test_jobs_started_together_prepare_the_built_in_corpus_once(tmp_path, monkeypatch):
    """Two `loom train` with no data started at once: the first prepares the cache, the other waits for it and
    reuses it (both writing one temporary folder made the second fail with 'cannot write shard')."""
    import threading
    import time

    import loom.data.prepare as prep
    from loom.config import load_config
    from loom.train.setup import resolve_data

    calls = []

    def slow_prepare(name, out, *args, **kw):
        calls.append(out)
        time.sleep(0.5)  # the other job arrives meanwhile
        out.mkdir(parents=True)
        (out / "meta.json").write_text("{}")

    monkeypatch.setattr(prep, "prepare_corpus", slow_prepare)
    monkeypatch.setattr("loom.train.setup.check_data_dir", lambda p: {})
    cfg = load_config(None, [f"--data.cache_dir={tmp_path}"])
    got = []
    jobs = [threading.Thread(target=lambda: got.append(resolve_data(cfg))) for _ in range(2)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1] == calls[0]
