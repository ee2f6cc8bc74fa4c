"""Token shards against llm.c's on-disk format.

Compared against: the header layout llm.c writes (`write_datafile` in llm.c's dev/data/data_common.py):
256 little-endian int32s — [0] magic 20240520, [1] version (1 = uint16 tokens, 2 = uint32), [2] token
count, the rest zero — followed by the tokens. The expected bytes are built here with plain numpy, not
with loom, so a shard written by loom is checked against what llm.c would read.
"""

from __future__ import annotations

import numpy as np
import pytest

from loom.data.shards import (
    HEADER_BYTES,
    MAGIC,
    read_header,
    read_shard,
    version_for_vocab,
    write_shard,
)
from loom.errors import LoomError


def _llmc_bytes(tokens, version: int, count: int | None = None, magic: int = MAGIC) -> bytes:
    """A shard the way llm.c writes it (independent of loom's writer)."""
    header = np.zeros(256, dtype="<i4")
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    dtype = {1: "<u2", 2: "<u4"}.get(version, "<u2")
    return header.tobytes() + np.asarray(tokens, dtype=dtype).tobytes()


def test_header_is_256_int32():
    assert HEADER_BYTES == 1024
    assert MAGIC == 20240520


@pytest.mark.parametrize(
    ("version", "tokens", "itemsize"),
    [
        (1, [0, 1, 65535, 42, 7], 2),
        (2, [0, 65536, 2**32 - 1, 100_000, 3], 4),
    ],
)
def test_roundtrip_and_header_fields(tmp_path, version, tokens, itemsize):
    path = tmp_path / "s.bin"
    write_shard(path, np.array(tokens, dtype=np.int64), version)

    raw = path.read_bytes()
    assert len(raw) == 1024 + len(tokens) * itemsize
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[0] == 20240520
    assert header[1] == version
    assert header[2] == len(tokens)
    assert not header[3:].any()
    # Byte-identical to what llm.c writes.
    assert raw == _llmc_bytes(tokens, version)

    assert read_header(path) == (version, len(tokens))
    got = read_shard(path)
    assert got.dtype == (np.uint16 if version == 1 else np.uint32)
    assert got.tolist() == tokens
    assert not (tmp_path / "s.bin.tmp").exists()


def test_reads_a_shard_written_by_llmc(tmp_path):
    path = tmp_path / "llmc.bin"
    path.write_bytes(_llmc_bytes([5, 4, 3, 2, 1], 1))
    assert read_shard(path).tolist() == [5, 4, 3, 2, 1]


def test_write_picks_version_from_largest_id(tmp_path):
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    write_shard(small, np.array([0, 65535]))
    write_shard(big, np.array([0, 65536]))
    assert read_header(small) == (1, 2)
    assert read_header(big) == (2, 2)
    assert read_shard(big).tolist() == [0, 65536]


def test_empty_shard(tmp_path):
    path = tmp_path / "e.bin"
    write_shard(path, np.zeros(0, dtype=np.int64), 1)
    assert path.stat().st_size == 1024
    assert read_header(path) == (1, 0)
    assert len(read_shard(path)) == 0


def test_version_for_vocab():
    assert version_for_vocab(1) == 1
    assert version_for_vocab(50257) == 1  # GPT-2
    assert version_for_vocab(65536) == 1  # ids 0..65535 all fit in uint16
    assert version_for_vocab(65537) == 2
    assert version_for_vocab(100_277) == 2  # cl100k


def test_wrong_magic(tmp_path):
    path = tmp_path / "m.bin"
    path.write_bytes(_llmc_bytes([1, 2, 3], 1, magic=20240519))
    with pytest.raises(LoomError, match="magic"):
        read_shard(path)


def test_shorter_than_header(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(_llmc_bytes([1, 2, 3], 1)[:500])
    with pytest.raises(LoomError, match="shorter than the 1024-byte"):
        read_shard(path)


def test_fewer_tokens_than_header_says(tmp_path):
    path = tmp_path / "t.bin"
    path.write_bytes(_llmc_bytes([1, 2, 3, 4], 1)[:-2])  # last token cut off
    with pytest.raises(LoomError, match="header says 4 tokens"):
        read_shard(path)


def test_header_count_shorter_than_file(tmp_path):
    path = tmp_path / "l.bin"
    path.write_bytes(_llmc_bytes([1, 2, 3, 4], 1, count=2))  # header says 2, the file holds 4
    with pytest.raises(LoomError, match="header says 2 tokens"):
        read_header(path)


def test_negative_count(tmp_path):
    path = tmp_path / "n.bin"
    path.write_bytes(_llmc_bytes([], 1, count=-1))
    with pytest.raises(LoomError):
        read_header(path)


@pytest.mark.parametrize("version", [0, 3, 7])
def test_unknown_version(tmp_path, version):
    path = tmp_path / "v.bin"
    path.write_bytes(_llmc_bytes([1, 2], version))
    with pytest.raises(LoomError, match=f"unknown version {version}"):
        read_shard(path)


def test_id_too_large_for_uint16(tmp_path):
    path = tmp_path / "big.bin"
    with pytest.raises(LoomError, match="does not fit in uint16"):
        write_shard(path, np.array([1, 70_000]), version=1)
    assert not path.exists()
    assert not (tmp_path / "big.bin.tmp").exists()


def test_negative_id_is_refused(tmp_path):
    path = tmp_path / "neg.bin"
    with pytest.raises(LoomError):
        write_shard(path, np.array([-1, 5]), version=1)
    assert not path.exists()
