"""Token formats against the layouts their own projects write.

Compared against: reference writers built here with plain numpy/struct, independent of loom, each
following its project's code — llm.c's `write_datafile` (256 x int32 header), nanoGPT's
data/shakespeare_char/prepare.py (`np.uint16(...).tofile`, `pickle.dump(meta)`), build-nanogpt's
fineweb.py (`np.save` of uint16 shards named `edufineweb_{split}_{i:06d}`), and Megatron-LM's
`IndexedDatasetBuilder` / `_IndexWriter` (megatron/core/datasets/indexed_dataset.py). Every pair of
formats is converted both ways through the CLI entry point and must give back the same token streams
(and the same documents where both formats keep them).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys

import numpy as np
import pytest

from loom.data import formats as F
from loom.data.convert import data_convert_main, data_inspect_main, inspect
from loom.data.loader import ShardLoader, read_meta
from loom.data.safe_pickle import load_restricted, read_meta_pkl
from loom.data.tokenizers import load_tokenizer
from loom.errors import LoomError

EOT = 999  # every document starts with it (llm.c / loom convention)
FORMATS = list(F.TOKEN_FORMATS)


def _tokens(docs: list) -> F.Tokens:
    """Tokens holding `docs` one after another, with their document offsets."""
    arrays = [np.asarray(d).reshape(-1) for d in docs]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    return F.Tokens(ids, np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64))


def make_docs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        np.concatenate([[EOT], rng.integers(0, EOT, rng.integers(3, 40))]).astype(np.int64) for _ in range(n)
    ]


TRAIN = [make_docs(6, 1), make_docs(5, 2)]  # two shards (one file for nanoGPT)
VAL = [make_docs(4, 3)]


def stream(shards) -> np.ndarray:
    return np.concatenate([d for docs in shards for d in docs])


# ------------------------------------------------------------------ reference writers (not loom's code)


def ref_llmc(path, ids, version=1):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, version, len(ids))
    path.write_bytes(header.tobytes() + np.asarray(ids, {1: "<u2", 2: "<u4"}[version]).tobytes())


def ref_megatron(prefix, docs_of_sequences, dtype="<u2", code=8, magic=b"MMIDIDX\x00\x00"):
    """Megatron's builder: add_item per sequence, end_document per document; then _IndexWriter.write."""
    lengths, doc_idx, data = [], [0], []
    for doc in docs_of_sequences:
        for seq in doc:
            data.append(np.asarray(seq, dtype))
            lengths.append(len(seq))
        doc_idx.append(len(lengths))
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * itemsize if lengths else []
    prefix.with_name(prefix.name + ".bin").write_bytes(b"".join(a.tobytes() for a in data))
    idx = magic + struct.pack("<Q", 1) + struct.pack("<B", code)
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx))
    idx += np.asarray(lengths, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
    idx += np.asarray(doc_idx, "<i8").tobytes()
    prefix.with_name(prefix.name + ".idx").write_bytes(idx)


def write_reference(fmt, d):
    """A dataset directory as the format's own project lays it out (TRAIN: 2 shards, VAL: 1)."""
    d.mkdir(parents=True)
    if fmt == "llmc":  # llm.c's names, no meta.json
        for i, docs in enumerate(TRAIN):
            ref_llmc(d / f"fineweb_train_{i + 1:06d}.bin", np.concatenate(docs))
        ref_llmc(d / "fineweb_val_000000.bin", np.concatenate(VAL[0]))
    elif fmt == "nanogpt":
        stream(TRAIN).astype(np.uint16).tofile(d / "train.bin")
        stream(VAL).astype(np.uint16).tofile(d / "val.bin")
    elif fmt == "npy":  # shard 0 is val, the rest train
        np.save(d / "edufineweb_val_000000", np.concatenate(VAL[0]).astype(np.uint16))
        for i, docs in enumerate(TRAIN):
            np.save(d / f"edufineweb_train_{i + 1:06d}", np.concatenate(docs).astype(np.uint16))
    elif fmt == "megatron":
        for i, docs in enumerate(TRAIN):
            ref_megatron(d / f"train_{i}_text_document", [[doc] for doc in docs])
        ref_megatron(d / "val_text_document", [[doc] for doc in VAL[0]])
    return d


def documents(data_dir, split):
    """The documents of a split as read back by loom (Megatron: from its index)."""
    fmt = F.detect_dir(data_dir)
    return [doc for p in F.split_files(data_dir, split, fmt) for doc in F.FORMATS[fmt].read(p).documents()]


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("src", FORMATS)
def test_open_split_reads_each_projects_layout(tmp_path, src):
    d = write_reference(src, tmp_path / src)
    for split, shards in (("train", TRAIN), ("val", VAL)):
        arrays = F.open_split(d, split)
        assert all(a.ndim == 1 and a.dtype.kind in "iu" for a in arrays)
        assert np.array_equal(np.concatenate(arrays), stream(shards))
    if src == "megatron":
        assert all(isinstance(a, np.memmap) for a in F.open_split(d, "train"))  # read in place


@pytest.mark.parametrize("dst", FORMATS)
@pytest.mark.parametrize("src", FORMATS)
def test_convert_every_pair_keeps_tokens_and_documents(tmp_path, src, dst):
    d = write_reference(src, tmp_path / src)
    out = tmp_path / f"{src}-to-{dst}"
    assert data_convert_main(["--from", src, "--to", dst, "--eot-id", str(EOT), str(d), str(out)]) == 0
    assert F.detect_dir(out) == dst
    for split, shards in (("train", TRAIN), ("val", VAL)):
        assert np.array_equal(np.concatenate(F.open_split(out, split)), stream(shards))
        if dst == "megatron":  # boundaries from the source's index, or recovered from end-of-text ids
            got = documents(out, split)
            want = [doc for docs in shards for doc in docs]
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    back = tmp_path / f"{src}-to-{dst}-to-{src}"
    assert data_convert_main(["--to", src, str(out), str(back)]) == 0  # --from detected
    assert np.array_equal(np.concatenate(F.open_split(back, "train")), stream(TRAIN))


def test_convert_records_the_eot_id_for_document_masks(tmp_path):
    """--eot-id is recorded in the output's meta (tokenizer.eot_id): data.doc_mask and data.align=bos read
    it there; an entry of just the id is not a tokenizer to load (has_tokenizer)."""
    from loom.data.loader import doc_eot_id, read_meta
    from loom.data.tokenizers import has_tokenizer

    d = write_reference("llmc", tmp_path / "llmc")
    out = tmp_path / "m"
    assert data_convert_main(["--to", "megatron", "--eot-id", str(EOT), str(d), str(out)]) == 0
    meta = read_meta(out)
    assert doc_eot_id(out, meta, doc_mask=True) == EOT and not has_tokenizer(meta)


def test_megatron_documents_of_several_sequences(tmp_path):
    """A document made of several sequences (sentence-split preprocessing) is still one document."""
    ref_megatron(tmp_path / "ds", [[[1, 2], [3]], [[4, 5, 6]], [[7], [8], [9, 10]]])
    t = F.FORMATS["megatron"].read(tmp_path / "ds")
    assert t.ids.tolist() == list(range(1, 11))
    assert [d.tolist() for d in t.documents()] == [[1, 2, 3], [4, 5, 6], [7, 8, 9, 10]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_writers_match_the_reference_bytes(tmp_path, fmt):
    docs = TRAIN[0]
    ids = np.concatenate(docs)
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    if fmt == "megatron":
        F.FORMATS[fmt].write(ours, _tokens(docs))
        ref_megatron(ref, [[d] for d in docs])
        pairs = [(".bin", ".bin"), (".idx", ".idx")]
    else:
        F.FORMATS[fmt].write(ours, F.Tokens(ids), "uint16")
        if fmt == "llmc":
            ref_llmc(ref, ids)
        elif fmt == "nanogpt":
            ids.astype(np.uint16).tofile(ref)
        else:
            with open(ref, "wb") as f:
                np.save(f, ids.astype(np.uint16))
        pairs = [("", "")]
    for a, b in pairs:
        assert (tmp_path / f"ours{a}").read_bytes() == (tmp_path / f"ref{b}").read_bytes()


def test_training_reads_a_foreign_directory_like_loom_shards(tmp_path):
    """ShardLoader over each format in place gives the batches it gives over the same shards converted."""
    for fmt in FORMATS:
        d = write_reference(fmt, tmp_path / fmt)
        loom_dir = tmp_path / f"{fmt}-loom"
        data_convert_main(["--to", "llmc", str(d), str(loom_dir)])
        assert [p.name for p in F.split_files(loom_dir, "train")][0] == "train_000000.bin"
        a, b = (ShardLoader(x, batch_size=4, block_size=8, seed=0) for x in (d, loom_dir))
        for _ in range(5):
            assert all(np.array_equal(x, y) for x, y in zip(a.next_batch(), b.next_batch(), strict=True))


def test_single_file_conversion(tmp_path):
    ref_megatron(tmp_path / "corpus_text_document", [[d] for d in VAL[0]])
    npy = tmp_path / "corpus.npy"
    assert data_convert_main(["--to", "npy", str(tmp_path / "corpus_text_document"), str(npy)]) == 0
    assert np.array_equal(np.load(npy), stream(VAL)) and np.load(npy).dtype == np.uint16
    with pytest.raises(LoomError, match="already exists"):
        data_convert_main(["--to", "npy", str(tmp_path / "corpus_text_document.bin"), str(npy)])
    assert (
        data_convert_main(["--to", "megatron", "--eot-id", str(EOT), str(npy), str(tmp_path / "again")]) == 0
    )
    assert len(F.FORMATS["megatron"].read(tmp_path / "again").documents()) == len(VAL[0])


def test_eot_id_outside_the_vocabulary_is_refused_and_documents_are_counted(tmp_path, capsys):
    """An --eot-id the data cannot hold started no document: the Megatron index held one per file."""
    d = write_reference("llmc", tmp_path / "llmc")  # no meta: the vocabulary is max id + 1 = EOT + 1
    for src in (d, d / "fineweb_val_000000.bin"):
        out = tmp_path / "m"
        with pytest.raises(
            LoomError, match=rf"--eot-id {EOT + 1} is outside the vocabulary of .*\(ids 0\.\.{EOT}"
        ) as e:
            data_convert_main(["--to", "megatron", "--eot-id", str(EOT + 1), str(src), str(out)])
        assert "--eot-id" in e.value.hint
        assert not list(tmp_path.glob("m*")) and not list(tmp_path.glob(".m*"))  # nothing written
    capsys.readouterr()
    assert data_convert_main(["--to", "megatron", "--eot-id", str(EOT), str(d), str(tmp_path / "m")]) == 0
    said = capsys.readouterr().out
    assert f"train {len(stream(TRAIN)):,} tokens in 2 file(s) ({sum(map(len, TRAIN))} documents)" in said, (
        said
    )
    assert f"({len(VAL[0])} documents)" in said, said
    prefix = tmp_path / "one"
    assert (
        data_convert_main(
            ["--to", "megatron", "--eot-id", str(EOT), str(d / "fineweb_val_000000.bin"), str(prefix)]
        )
        == 0
    )
    assert f"({len(VAL[0])} documents)" in capsys.readouterr().out


def test_convert_refuses_existing_output_and_leaves_nothing_on_failure(tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    ref_llmc(d / "x_train.bin", [1, 70000, 3], version=2)
    ref_llmc(d / "x_val.bin", [5, 6], version=2)
    out = tmp_path / "out"
    with pytest.raises(LoomError, match="largest token id, 70000, does not fit in uint16"):
        data_convert_main(["--to", "nanogpt", str(d), str(out)])
    assert not out.exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(LoomError, match="already exists"):
        data_convert_main(["--to", "npy", str(d), str(out)])
    assert (out / "keep").exists()
    with pytest.raises(LoomError, match="not a folder loom wrote"):  # --force replaces only loom's output
        data_convert_main(["--to", "npy", "--force", str(d), str(out)])
    assert (out / "keep").exists()
    (out / "keep").unlink()
    assert data_convert_main(["--to", "npy", str(d), str(out)]) == 0
    assert data_convert_main(["--to", "npy", "--force", str(d), str(out)]) == 0
    assert F.open_split(out, "train")[0].dtype == np.uint32  # widened: 70000 needs more than 16 bits


@pytest.mark.parametrize("fmt", FORMATS)
def test_writers_refuse_ids_beyond_uint16(tmp_path, fmt):
    with pytest.raises(LoomError, match="largest token id, 65536, does not fit in uint16"):
        F.FORMATS[fmt].write(tmp_path / "x", F.Tokens(np.array([0, 65536, 7])), "uint16")
    with pytest.raises(LoomError, match="negative"):
        F.FORMATS[fmt].write(tmp_path / "y", F.Tokens(np.array([0, -1])), "uint16")
    assert not [p for p in tmp_path.iterdir()]


# ------------------------------------------------------------------ nanoGPT meta.pkl


NANOGPT_CHARS = sorted(set("First Citizen:\nBefore we proceed any further, hear me speak.\n"))


def nanogpt_meta():
    """Exactly nanoGPT's data/shakespeare_char/prepare.py."""
    stoi = {ch: i for i, ch in enumerate(NANOGPT_CHARS)}
    itos = {i: ch for i, ch in enumerate(NANOGPT_CHARS)}
    return {"vocab_size": len(NANOGPT_CHARS), "itos": itos, "stoi": stoi}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_meta_pkl_is_parsed_without_unpickling(tmp_path, protocol):
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(nanogpt_meta(), f, protocol=protocol)
    assert read_meta_pkl(tmp_path / "meta.pkl") == nanogpt_meta()


def test_nanogpt_directory_with_meta_pkl_decodes(tmp_path):
    meta = nanogpt_meta()
    text = "hear me speak.\nFirst Citizen:"
    ids = np.array([meta["stoi"][c] for c in text], dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    ids.tofile(tmp_path / "val.bin")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    m = read_meta(tmp_path)
    # one id more than nanoGPT's: loom's end-of-text id, which samples start from, must exist in the model
    assert m["vocab_size"] == len(NANOGPT_CHARS) + 1 and m["nanogpt_vocab_size"] == len(NANOGPT_CHARS)
    assert load_tokenizer(tmp_path, m).decode(ids.tolist()) == text
    assert inspect(tmp_path, sample_tokens=len(text))["sample"] == text
    (tmp_path / "meta.pkl").unlink()  # the same vocabulary as meta.json (JSON keys are strings)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert load_tokenizer(tmp_path, read_meta(tmp_path)).decode(ids.tolist()) == text
    out = tmp_path / "nano"
    data_convert_main(["--to", "nanogpt", str(tmp_path), str(out)])
    assert read_meta_pkl(out / "meta.pkl") == meta  # nanoGPT's own table, written back as it was


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [0, 2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_malicious_meta_pkl_is_refused_and_never_runs(tmp_path, protocol):
    marker = tmp_path / "pwned"
    data = pickle.dumps({"vocab_size": 3, "itos": {0: "a"}, "x": _Evil(marker)}, protocol=protocol)
    (tmp_path / "meta.pkl").write_bytes(data)
    np.zeros(4, np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(LoomError, match="opcode .* refused"):
        read_meta(tmp_path)
    with pytest.raises(LoomError, match="refused"):
        data_inspect_main([str(tmp_path)])
    assert not marker.exists()


@pytest.mark.parametrize(
    "obj, match",
    [([1, 2], "opcode"), ({"a": 1.5}, "opcode"), ({"a": True}, "bool|opcode"), ({(1, 2): 3}, "opcode")],
)
def test_meta_pkl_other_types_refused(obj, match):
    with pytest.raises(LoomError, match=match):
        load_restricted(pickle.dumps(obj))


def test_meta_pkl_garbage():
    with pytest.raises(LoomError, match="not a readable pickle|single dict"):
        load_restricted(b"\x80\x04garbage")


# ------------------------------------------------------------------ malformed inputs


def _megatron(tmp_path):
    ref_megatron(tmp_path / "ds", [[d] for d in VAL[0]])
    return tmp_path / "ds.idx", tmp_path / "ds.bin"


def test_megatron_wrong_magic(tmp_path):
    idx, _ = _megatron(tmp_path)
    idx.write_bytes(b"NOTMAGIC!" + idx.read_bytes()[9:])
    with pytest.raises(LoomError, match=r"ds\.idx.*not a Megatron \.idx"):
        F.FORMATS["megatron"].read(tmp_path / "ds")


@pytest.mark.parametrize("keep", [0, 5, 20, 40])
def test_megatron_truncated_index(tmp_path, keep):
    idx, _ = _megatron(tmp_path)
    idx.write_bytes(idx.read_bytes()[:keep])
    with pytest.raises(LoomError, match=r"ds\.idx.*truncated"):
        F.FORMATS["megatron"].read(tmp_path / "ds.bin")


def test_megatron_truncated_data(tmp_path):
    _, binp = _megatron(tmp_path)
    binp.write_bytes(binp.read_bytes()[:-3])
    with pytest.raises(LoomError, match=r"ds\.bin.*truncated"):
        F.FORMATS["megatron"].read(tmp_path / "ds")


def test_megatron_float_dtype(tmp_path):
    ref_megatron(tmp_path / "ds", [[[1.0, 2.0]]], dtype="<f4", code=7)
    with pytest.raises(LoomError, match="float32 values, not integer token ids"):
        F.FORMATS["megatron"].read(tmp_path / "ds")


@pytest.mark.parametrize(
    "arr, match",
    [
        (np.arange(5, dtype=np.float32), "float32 values, not integer token ids"),
        (np.zeros((2, 3), np.uint16), "2-D array"),
        (np.array([{"a": 1}], dtype=object), "not a readable .npy"),
    ],
)
def test_npy_non_token_arrays(tmp_path, arr, match):
    np.save(tmp_path / "edufineweb_train_000001.npy", arr, allow_pickle=True)
    with pytest.raises(LoomError, match=match):
        F.open_split(tmp_path, "train")


def test_nanogpt_odd_size(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(LoomError, match="whole number of uint16"):
        F.open_split(tmp_path, "train")


# ------------------------------------------------------------------ directories, meta, inspect


def test_meta_without_vocabulary_is_max_id_plus_one(tmp_path):
    d = write_reference("npy", tmp_path / "npy")
    m = read_meta(d)
    assert m["vocab_size"] == EOT + 1 and m["tokenizer"] is None and m["format"] == "npy"
    assert F.check_dir(d) == m


def test_llmc_names_without_meta_are_accepted_loom_names_are_not(tmp_path):
    d = write_reference("llmc", tmp_path / "llmc")
    assert [p.name for p in F.split_files(d, "val")] == ["fineweb_val_000000.bin"]
    loom = tmp_path / "loomish"
    loom.mkdir()
    ref_llmc(loom / "train_000000.bin", [1, 2, 3])
    with pytest.raises(LoomError, match="no meta.json"):
        F.split_files(loom, "train")


def test_inspect_prepared_directory_decodes_a_sample(char_data, capsys):
    assert data_inspect_main(["--json", str(char_data)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "llmc" and info["tokenizer"] == "char"
    meta = json.loads((char_data / "meta.json").read_text())
    for split in ("train", "val"):
        s = info["splits"][split]
        assert (
            s["tokens"] == meta["splits"][split]["tokens"]
            and s["documents"] == meta["splits"][split]["documents"]
        )
        assert s["dtype"] == ["uint16"] and s["max_id"] < meta["vocab_size"]
    tok = load_tokenizer(char_data, meta)
    first = F.open_split(char_data, "val")[0][:64].tolist()
    assert info["sample"] == tok.decode(first)
    assert data_inspect_main([str(char_data)]) == 0  # the human table
    assert "decoded:" in capsys.readouterr().out


def test_inspect_megatron_counts_documents(tmp_path, capsys):
    d = write_reference("megatron", tmp_path / "m")
    info = inspect(d)
    assert info["splits"]["train"]["documents"] == sum(len(s) for s in TRAIN)
    assert info["splits"]["train"]["documents_from"] == "index"
    assert info["sample"] is None and info["vocab_size"] == EOT + 1


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(LoomError, match=r"loom\[parquet\]"):
        F.read_parquet_texts(tmp_path / "t.parquet")
    with pytest.raises(LoomError, match="holds text, not token ids"):
        data_convert_main(["--to", "npy", str(tmp_path / "t.parquet"), str(tmp_path / "o.npy")])


def test_parquet_text_column_is_a_prepare_input(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from loom.data.prepare import prepare
    from loom.data.sources import ReadOptions, ReadStats, input_files, iter_units

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["first doc", "", "second doc"], "id": [1, 2, 3]}), path)
    stats = ReadStats()  # as loom data prepare streams it
    assert [u.text for u in iter_units(input_files([path], "*", stats), ReadOptions(), stats)] == [
        "first doc",
        "second doc",
    ]
    with pytest.raises(LoomError, match="no column 'body'"):
        prepare([path], tmp_path / "out", jsonl_field="body")


def test_a_folder_of_two_token_formats_is_refused(tmp_path):
    """llm.c shards beside .npy shards trained silently on the .npy ones; a Megatron .bin is its .idx's."""
    d = write_reference("llmc", tmp_path / "mixed")
    np.save(d / "edufineweb_train_000001", np.arange(5, dtype=np.uint16))
    for call in (F.detect_dir, lambda x: F.open_split(x, "train"), inspect):
        with pytest.raises(
            LoomError,
            match=r"holds token files of 2 formats \(\.npy: edufineweb_train_000001"
            r"\.npy; llm\.c/nanoGPT \.bin: fineweb_train_000001\.bin",
        ) as e:
            call(d)
        assert "one format per directory" in e.value.hint
    with pytest.raises(LoomError, match="2 formats"):
        data_convert_main(["--to", "megatron", str(d), str(tmp_path / "out")])
    assert (
        F.detect_dir(write_reference("megatron", tmp_path / "meg")) == "megatron"
    )  # .bin + .idx: one format


def test_inspect_takes_a_headerless_bin_for_nanogpt_only_with_evidence(tmp_path):
    """An arbitrary binary was reported as nanoGPT tokens."""
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(4000))
    with pytest.raises(LoomError, match="'.*blob.bin' is not a token file loom knows") as e:
        inspect(blob)
    assert "--format nanogpt" in e.value.hint
    with pytest.raises(LoomError, match="not a token file loom knows") as e:
        data_convert_main(["--to", "npy", str(blob), str(tmp_path / "x.npy")])
    assert "--from nanogpt" in e.value.hint
    assert inspect(blob, "nanogpt")["format"] == "nanogpt"  # named: read as asked
    named = tmp_path / "nano" / "train.bin"
    named.parent.mkdir()
    named.write_bytes(np.arange(10, dtype="<u2").tobytes())
    assert inspect(named)["format"] == "nanogpt"
    with open(tmp_path / "meta.pkl", "wb") as f:  # its vocabulary beside it
        pickle.dump(nanogpt_meta(), f)
    assert inspect(blob)["format"] == "nanogpt"
