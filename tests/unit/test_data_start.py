"""Fast start on a token directory without meta.json, and `loom data inspect --write-meta` (issue 19).

Compared against: the ids written (max id + 1 over every token, after --write-meta) and what read_meta
reads without a meta (the start of each shard only).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from loom.data import formats
from loom.data.convert import data_inspect_main
from loom.data.loader import ShardLoader
from loom.data.shards import write_shard
from loom.errors import LoomError


def llmc_dir(d):
    d.mkdir()
    ids = np.arange(5000, dtype=np.uint16) % 100
    ids[2500] = 999  # a high id past the start of the shard
    write_shard(d / "fineweb_train_000001.bin", ids, version=1)
    write_shard(d / "fineweb_val_000000.bin", ids[:2000], version=1)
    return d


def test_no_meta_reads_only_each_shards_start_then_write_meta_records_all(tmp_path, monkeypatch):
    d = llmc_dir(tmp_path / "d")
    monkeypatch.setattr(formats, "_ID_CHECK_TOKENS", 2000)  # 1000 tokens of each shard
    m = formats.read_meta(d)
    assert m["vocab_size"] == 100 and m["vocab_from"] == "max id + 1 of each shard's start"
    assert formats.check_dir(d)["vocab_size"] == 100
    ShardLoader(d, 4, 64, seed=0).next_batch()  # starts without a meta.json
    assert data_inspect_main([str(d), "--write-meta", "--sample-tokens", "0"]) == 0
    meta = json.loads((d / "meta.json").read_text())
    assert meta["vocab_size"] == 1000 and meta["tokenizer"] is None
    assert meta["splits"]["train"]["tokens"] == 5000 and meta["splits"]["val"]["shards"] == 1
    assert formats.read_meta(d)["vocab_size"] == 1000
    ShardLoader(d, 4, 64, seed=0).next_batch()  # still the llm.c file names, now with a meta
    with pytest.raises(LoomError, match="already has a meta"):
        data_inspect_main([str(d), "--write-meta"])


def test_megatron_training_reader_is_one_memory_map(tmp_path):
    from loom.data import megatron

    ids = np.arange(3000, dtype=np.int64) % 500
    megatron.write(tmp_path / "ds", ids, np.array([0, 100, 1700, 3000]), np.uint16)
    got = megatron.read_ids(tmp_path / "ds")
    assert isinstance(got, np.memmap) and np.array_equal(got, megatron.read(tmp_path / "ds").ids)


def test_ids_past_the_vocabulary_stop_at_the_batch_that_holds_them(tmp_path, monkeypatch):
    d = llmc_dir(tmp_path / "d")
    monkeypatch.setattr(formats, "_ID_CHECK_TOKENS", 2000)  # the sample misses the id 999 at the end
    loader = ShardLoader(d, 77, 64, seed=0)  # 77 windows: the whole train split, one of them holds 999
    with pytest.raises(LoomError, match="token id 999, outside the vocabulary of 100") as e:
        loader.next_batch()
    assert "--write-meta" in e.value.hint
