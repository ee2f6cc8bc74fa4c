"""data.align=bos: training windows start at document starts (issue 19).

Compared against: the document starts written into the shard (every row begins with the end-of-text id),
and a count of the tokens no window covers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loom.data.loader import ShardLoader, TokenWindows, bos_starts
from loom.data.shards import write_shard
from loom.errors import LoomError

EOT = 0


def shard(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[EOT], rng.integers(1, 50, size=int(n))]) for n in rng.integers(1, 40, size=200)]
    return np.concatenate(docs).astype(np.uint16)


def test_windows_start_at_documents_and_drops_are_counted():
    ids = shard()
    T = 16
    starts = bos_starts(ids, EOT, T, chunk=100)  # chunked scan gives the same as one pass
    assert np.array_equal(starts, bos_starts(ids, EOT, T))
    assert (ids[starts] == EOT).all() and (np.diff(starts) >= T).all() and starts[-1] + T + 1 <= len(ids)
    w = TokenWindows([ids], T, bos_id=EOT)
    rows = w.rows(np.arange(w.n))
    assert (rows[:, 0] == EOT).all()
    assert w.dropped == len(ids) - w.n * T > 0
    covered = np.zeros(len(ids), bool)
    for s in starts:
        covered[s : s + T] = True
    assert w.dropped == len(ids) - covered.sum()


def test_loader_reads_the_eot_id_from_meta(tmp_path, capsys):
    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", shard(), 1)
    (tmp_path / "meta.json").write_text(
        json.dumps({"vocab_size": 50, "tokenizer": {"kind": "x", "eot_id": EOT}})
    )
    loader = ShardLoader(tmp_path, 8, 16, seed=0, align="bos")
    x, _ = loader.next_batch()
    assert (x[:, 0] == EOT).all()
    out = capsys.readouterr()
    assert f"{loader.windows.dropped:,} of" in out.out + out.err and loader.windows.dropped > 0
    with pytest.raises(LoomError, match="none or bos"):
        ShardLoader(tmp_path, 8, 16, seed=0, align="eos")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50, "tokenizer": None}))
    with pytest.raises(LoomError, match="end-of-text id"):
        ShardLoader(tmp_path, 8, 16, seed=0, align="bos")


def test_document_starts_are_scanned_once_and_read_back_from_the_cache(tmp_path, monkeypatch):
    from loom.data import loader as loader_mod

    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", shard(), 1)
    (tmp_path / "meta.json").write_text(
        json.dumps({"vocab_size": 50, "tokenizer": {"kind": "x", "eot_id": EOT}})
    )
    scans = []
    real = loader_mod.bos_starts
    monkeypatch.setattr(loader_mod, "bos_starts", lambda *a, **k: scans.append(1) or real(*a, **k))
    first = ShardLoader(tmp_path, 8, 16, seed=0, align="bos")
    again = ShardLoader(tmp_path, 8, 16, seed=0, align="bos")  # the next start, another rank
    assert len(scans) == 1
    assert np.array_equal(again.windows.starts[0], first.windows.starts[0])
    assert torch.equal(again.next_batch()[0], first.next_batch()[0])
    ShardLoader(tmp_path, 8, 24, seed=0, align="bos")  # another block size: its own entry
    write_shard(tmp_path / "train_000000.bin", shard()[:-16], 1)  # the shard rewritten
    ShardLoader(tmp_path, 8, 16, seed=0, align="bos")
    assert len(scans) == 3
