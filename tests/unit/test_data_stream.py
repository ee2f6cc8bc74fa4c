"""Streaming `loom data prepare` (issue 19): every input kind, pieces, workers, encoders, bad input.

Compared against: the input text itself (shards decoded with the saved tokenizer give back the documents),
the same corpus prepared from another input kind or with another number of worker processes (byte-identical
shards), and the tokenizers library's own ids (tiktoken and a loom-trained tokenizer loaded by the library).
"""

from __future__ import annotations

import gzip
import json
import signal
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import pytest

from loom.data import encode
from loom.data.encode import Encoder, tiktoken_spec
from loom.data.prepare import encoder_spec, prepare
from loom.data.shards import read_shard
from loom.data.sources import ReadOptions, ReadStats, input_files, iter_units
from loom.data.split import Splitter
from loom.data.tokenizers import HFTokenizer, load_tokenizer
from loom.errors import LoomError

DOCS = [f"def f{i}(x):\n    return x * {i}  # naïve {'é' * (i % 3)}\nprint(f{i}(2))\n" for i in range(60)]


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.bin"))}


def decoded_documents(out: Path) -> list[str]:
    meta = json.loads((out / "meta.json").read_text())
    tok = load_tokenizer(out, meta)
    docs = []
    for split in ("train", "val"):
        ids = np.concatenate(
            [np.asarray(read_shard(p), np.int64) for p in sorted(out.glob(f"{split}_*.bin"))]
        )
        cuts = [*np.flatnonzero(ids == tok.eot_id), len(ids)]
        docs += [tok.decode(ids[a + 1 : b].tolist()) for a, b in zip(cuts, cuts[1:], strict=False)]
    return docs


def write_jsonl(path: Path, docs, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return path


def test_every_input_kind_gives_the_same_shards(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    plain = write_jsonl(tmp_path / "d.jsonl", DOCS)
    gz = write_jsonl(tmp_path / "d.jsonl.gz", DOCS, gzip.open)
    zst = tmp_path / "d.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS}), parquet, row_group_size=7)  # read one row group at a time
    outs = {}
    for name, path in {"jsonl": plain, "gz": gz, "zst": zst, "parquet": parquet}.items():
        outs[name] = tmp_path / f"out_{name}"
        prepare([path], outs[name], tokenizer="char", seed=0, workers=1, shard_tokens=500)
    ref = shard_bytes(outs["jsonl"])
    assert len(ref) > 4
    for out in outs.values():
        assert shard_bytes(out) == ref
    assert sorted(decoded_documents(outs["parquet"])) == sorted(DOCS)


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    inp = write_jsonl(tmp_path / "d.jsonl", DOCS * 3)
    a, b = tmp_path / "a", tmp_path / "b"
    kw = dict(tokenizer="bpe", vocab_size=300, seed=1, shard_tokens=700, chunk_chars=600)
    ma = prepare([inp], a, workers=1, **kw)
    mb = prepare([inp], b, workers=2, **kw)
    assert shard_bytes(a) == shard_bytes(b)
    assert ma["splits"] == mb["splits"]
    assert 1.0 < ma["bytes_per_token_val"] < 8.0  # compression reported on val


def test_pool_workers_die_on_sigterm_whatever_handler_the_caller_has():
    """A forked worker inherits the caller's handlers; with a SIGTERM handler that does not exit (a training
    loop's), the pool's terminate left the workers alive and its exit waited forever (seen in a test
    process that had run `loom train` in-process). Workers restore the default at start."""
    spec = {"kind": "char", "chars": "ab", "eot_id": 2, "dtype": "uint16"}
    old = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        with get_context("fork").Pool(1, initializer=encode._init, initargs=(spec,)) as pool:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
            assert pool.apply(signal.getsignal, (signal.SIGINT,)) == signal.SIG_IGN  # Ctrl-C: the parent's
    finally:
        signal.signal(signal.SIGTERM, old)


def test_long_text_in_pieces_encodes_like_the_whole(tmp_path):
    text = "".join(DOCS * 5)
    inp = tmp_path / "one.txt"
    inp.write_text(text)
    stats = ReadStats()
    units = list(iter_units(input_files([inp], "*", stats), ReadOptions(piece_chars=200), stats))
    assert len(units) > 10 and units[0].new_doc and not any(u.new_doc for u in units[1:])
    assert "".join(u.text for u in units) == text
    tok = HFTokenizer.train(DOCS, 300)
    assert sum((tok.encode(u.text) for u in units), []) == tok.encode(text)  # cut where BPE splits anyway


def test_text_separator_and_doc_chars(tmp_path):
    inp = tmp_path / "t.txt"
    inp.write_text("first doc\n<SEP>second doc\n<SEP><SEP>third\n")
    stats = ReadStats()
    units = list(iter_units(input_files([inp], "*", stats), ReadOptions(text_separator="<SEP>"), stats))
    assert [u.text for u in units] == ["first doc\n", "second doc\n", "third\n"]
    assert all(u.new_doc for u in units)
    inp.write_text("".join(f"line {i}\n" for i in range(100)))
    units = list(iter_units(input_files([inp], "*", stats), ReadOptions(doc_chars=100), stats))
    assert len(units) > 5 and all(u.new_doc for u in units)
    assert "".join(u.text for u in units) == inp.read_text()


def test_split_is_deterministic_and_near_the_share():
    sizes = np.random.default_rng(0).integers(10, 2000, size=3000)

    def run(seed):
        sp = Splitter(0.1, "docs", seed)
        got = []
        for n in sizes:
            from loom.data.sources import Unit

            got += [s for s, _ in sp.feed(Unit("x" * int(n)))]
        got += [s for s, _ in sp.finish()]
        return got, sp

    a, sp = run(3)
    assert a == run(3)[0] and a != run(4)[0]
    share = sp.chars["val"] / (sp.chars["val"] + sp.chars["train"])
    assert abs(share - 0.1) < 0.01


def test_tiktoken_gives_the_tokenizers_ids_and_the_library_loads_loom_bpe(tmp_path):
    pytest.importorskip("tiktoken")  # an optional extra: loom[data]
    pytest.importorskip("rustbpe")
    for pattern, trainer in [
        ("gpt2", "rustbpe"),
        ("gpt4", "rustbpe"),
        ("gpt2", "tokenizers"),
        ("gpt4", "tokenizers"),
    ]:
        tok = HFTokenizer.train(DOCS, 320, pattern, trainer)
        spec = encoder_spec(tok)
        assert tiktoken_spec(spec["json"]) is not None
        fast = Encoder({**spec, "backend": "tiktoken", "tiktoken": tiktoken_spec(spec["json"])})
        texts = [*DOCS[:10], "It's 12345 naïve  spaces\n\n\tand ünïcode 🙂!!"]
        assert [list(x) for x in fast.ids(texts)] == [list(x) for x in Encoder(spec).ids(texts)]
        tok.save(tmp_path)
        from tokenizers import Tokenizer

        lib = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        assert [lib.encode(t, add_special_tokens=False).ids for t in texts] == [tok.encode(t) for t in texts]


def test_bad_input(tmp_path):
    good = write_jsonl(tmp_path / "d.jsonl", DOCS)
    gz = tmp_path / "bad.jsonl.gz"
    data = gzip.compress(good.read_bytes())
    gz.write_bytes(data[: len(data) // 2])  # cut short: the gzip member never ends
    with pytest.raises(LoomError, match="corrupt"):
        prepare([gz], tmp_path / "o1", strict=True)
    meta = prepare([gz], tmp_path / "o1", workers=1)  # the lines before the damage are kept, with a warning
    assert meta["corrupt_files"] == 1 and meta["documents"] > 0
    with pytest.raises(LoomError, match="does not fit in uint16") as e:
        prepare([tmp_path / "missing"], tmp_path / "o2", tokenizer="bpe", vocab_size=70_000, dtype="uint16")
    assert "uint32" in e.value.hint  # refused before reading (the input does not even exist)
    with pytest.raises(LoomError, match="does not exist"):
        prepare([tmp_path / "missing"], tmp_path / "o2")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(LoomError, match="corpus is empty"):
        prepare([tmp_path / "emptydir"], tmp_path / "o2")
    assert not (tmp_path / "o2").exists() and not (tmp_path / ".o2.loom-tmp").exists()


def test_unfinished_preparation_of_other_settings_is_refused(tmp_path):
    inp = write_jsonl(tmp_path / "d.jsonl", DOCS)
    tmp = tmp_path / ".out.loom-tmp"
    tmp.mkdir()
    (tmp / "progress.json").write_text(json.dumps({"fingerprint": "another"}))
    with pytest.raises(LoomError, match="unfinished preparation with other settings") as e:
        prepare([inp], tmp_path / "out")
    assert "--force" in e.value.hint
    prepare([inp], tmp_path / "out", force=True, workers=1)
    assert (tmp_path / "out" / "meta.json").is_file() and not tmp.exists()


def test_full_disk_leaves_no_complete_looking_shard(tmp_path, monkeypatch):
    import errno

    from loom.data import shards

    inp = write_jsonl(tmp_path / "d.jsonl", DOCS * 4)
    real_fsync, calls = shards.os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(shards.os, "fsync", fsync)
    with pytest.raises(LoomError, match="disk is full") as e:
        prepare([inp], tmp_path / "out", workers=1, shard_tokens=400, seed=0)
    assert "continues" in e.value.hint
    tmp = tmp_path / ".out.loom-tmp"
    assert sorted(p.name for p in tmp.glob("train_*")) == [
        "train_000000.bin",
        "train_000001.bin",
        "train_000002.bin.tmp",
    ]
    monkeypatch.setattr(shards.os, "fsync", real_fsync)
    prepare([inp], tmp_path / "out", workers=1, shard_tokens=400, seed=0)  # continues after space is freed
    prepare([inp], tmp_path / "ref", workers=1, shard_tokens=400, seed=0)
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
