"""Token shards in llm.c's format: a 256 x int32 header, then the tokens.

Header: [0] magic 20240520, [1] version (1 = uint16 tokens, 2 = uint32 tokens), [2] token count; the rest 0.
This is the layout llm.c and modded-nanogpt read and write, so their shards load as they are.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from loom.errors import LoomError

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
DTYPES = {1: np.uint16, 2: np.uint32}


def version_for_vocab(vocab_size: int) -> int:
    """Version 1 (uint16) while every id fits in 16 bits, else version 2 (uint32)."""
    return 1 if vocab_size <= 2**16 else 2


def write_shard(path: str | Path, tokens: np.ndarray, version: int | None = None) -> None:
    """Write tokens with the llm.c header; written to a temporary name, then renamed."""
    tokens = np.asarray(tokens)
    if version is None:
        version = version_for_vocab(int(tokens.max()) + 1 if tokens.size else 1)
    if version not in DTYPES:
        raise LoomError(f"unknown shard version {version} (known: 1 = uint16, 2 = uint32)")
    dtype = DTYPES[version]
    if tokens.size and int(tokens.min()) < 0:
        raise LoomError(f"token id {int(tokens.min())} is negative: not a valid token")
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise LoomError(
            f"token id {int(tokens.max())} does not fit in {np.dtype(dtype).name} (version {version})"
        )
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, version, tokens.size)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())
    os.replace(tmp, path)


def write_ids(f, ids: np.ndarray, dtype, chunk: int = 1 << 24) -> None:
    """Write ids to an open binary file as little-endian `dtype`, converted `chunk` tokens at a time (a
    memory map of billions of tokens is never copied whole)."""
    dt = np.dtype(dtype).newbyteorder("<")
    for i in range(0, len(ids), chunk):
        f.write(np.ascontiguousarray(ids[i : i + chunk], dtype=dt).tobytes())


def read_header(path: str | Path) -> tuple[int, int]:
    """Validate a shard's header against the file size; return (version, token count)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise LoomError(
            f"shard '{path}' is {size} bytes, shorter than the 1024-byte llm.c header (truncated?)"
        )
    header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    if int(header[0]) != MAGIC:
        raise LoomError(
            f"shard '{path}' has magic {int(header[0])}, not {MAGIC}: not an llm.c/loom token shard",
            hint="prepare the data with `loom data prepare` (or check the file is not corrupt)",
        )
    version, ntok = int(header[1]), int(header[2])
    if version not in DTYPES:
        raise LoomError(f"shard '{path}' has unknown version {version} (known: 1 = uint16, 2 = uint32)")
    expected = HEADER_BYTES + ntok * np.dtype(DTYPES[version]).itemsize
    if ntok < 0 or size != expected:
        raise LoomError(
            f"shard '{path}' header says {ntok} tokens ({expected} bytes) but the file has {size} bytes",
            hint="the shard is truncated or corrupt: prepare the data again",
        )
    return version, ntok


def read_shard(path: str | Path) -> np.ndarray:
    """Memory-map a shard's tokens after validating its header."""
    version, ntok = read_header(path)
    if ntok == 0:
        return np.zeros(0, dtype=DTYPES[version])
    return np.memmap(path, dtype=DTYPES[version], mode="r", offset=HEADER_BYTES, shape=(ntok,))


class ShardWriter:
    """Writes one split's tokens into fixed-size shards as they come, committing each when it is full.

    A shard is written as `<name>.tmp` (a zero header until it is complete), its header filled in, synced
    and renamed; then `on_commit(split, shards, position)` records progress. A crash or a full disk leaves
    at most a `.tmp` file, never a shard that looks complete. `position` is where the next shard's tokens
    begin: (chunk index, token offset in that chunk's output for this split)."""

    def __init__(self, directory: Path, split: str, shard_tokens: int, version: int, index: int, on_commit):
        self.dir, self.split, self.shard_tokens, self.version = Path(directory), split, shard_tokens, version
        self.dtype = np.dtype(DTYPES[version]).newbyteorder("<")
        self.index, self.on_commit = index, on_commit
        self.n = 0  # tokens in the open shard
        self.f = None
        self.tokens = 0  # tokens written by this writer

    def path(self, index: int) -> Path:
        return self.dir / f"{self.split}_{index:06d}.bin"

    def _write(self, ids: np.ndarray) -> None:
        try:
            if self.f is None:
                self.f = open(self.path(self.index).with_suffix(".bin.tmp"), "wb")  # noqa: SIM115
                self.f.write(bytes(HEADER_BYTES))
            self.f.write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        except OSError as e:
            raise _disk_error(self.path(self.index), e) from None
        self.n += len(ids)
        self.tokens += len(ids)

    def add(self, ids: np.ndarray, chunk: int, base: int) -> None:
        """Append ids: the tokens from offset `base` of chunk `chunk`'s output for this split."""
        i = 0
        while i < len(ids):
            take = min(len(ids) - i, self.shard_tokens - self.n)
            self._write(ids[i : i + take])
            i += take
            if self.n == self.shard_tokens:
                self.commit((chunk, base + i))

    def commit(self, position: tuple[int, int] | None) -> None:
        """Close the open shard (an empty one if none is open) and record it."""
        if self.f is None:
            self._write(np.zeros(0, self.dtype))
        header = np.zeros(HEADER_INTS, dtype=np.int32)
        header[:3] = (MAGIC, self.version, self.n)
        tmp = self.path(self.index).with_suffix(".bin.tmp")
        try:
            self.f.seek(0)
            self.f.write(header.tobytes())
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            self.f = None
            os.replace(tmp, self.path(self.index))
        except OSError as e:
            raise _disk_error(self.path(self.index), e) from None
        self.index += 1
        self.n = 0
        self.on_commit(self.split, self.index, position)

    def close(self) -> None:
        """Drop an open, uncommitted shard file handle (its .tmp stays, never looking complete)."""
        if self.f is not None:
            self.f.close()
            self.f = None


def _disk_error(path: Path, e: OSError) -> LoomError:
    import errno

    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
    what = "the disk is full" if full else f"{type(e).__name__}: {e}"
    return LoomError(
        f"cannot write shard '{path}': {what}",
        hint="free some space and run the same command again: it continues from the last complete shard",
    )
