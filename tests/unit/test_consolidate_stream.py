"""`loom ckpt consolidate` reads DCP's files itself, chunk by chunk (loom.checkpoint_tools._write_tensor):
row blocks (FSDP's shards) are copied file to file, column blocks (tensor parallel) are assembled; the bytes
written must equal the whole tensor, and a truncated or foreign chunk is one clear error."""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from loom import checkpoint_tools as ct
from loom.errors import LoomError


def _save(tmp_path, whole: torch.Tensor, dim: int, parts: int, raw: bool = False, view: bool = False):
    """Write `whole` split along `dim` into one file the way DCP does; return its metadata and storage map."""
    f = tmp_path / "__0_0.distcp"
    chunks, storage = [], {}
    with open(f, "wb") as fh:
        for i, piece in enumerate(whole.chunk(parts, dim)):
            offsets = [0] * whole.dim()
            offsets[dim] = sum(p.shape[dim] for p in whole.chunk(parts, dim)[:i])
            c = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape)
            start = fh.tell()
            if raw:
                fh.write(piece.contiguous().view(torch.uint8).numpy().tobytes())
            else:
                buf = io.BytesIO()
                # a view into a larger storage: torch.save keeps the whole storage and an offset
                torch.save(piece if view else piece.contiguous(), buf)
                fh.write(buf.getvalue())
            storage[MetadataIndex("w", c.offsets)] = _StorageInfo(f.name, start, fh.tell() - start)
            chunks.append(c)
    meta = TensorStorageMetadata(TensorProperties(dtype=whole.dtype), whole.shape, chunks[::-1])
    return meta, storage


@pytest.mark.parametrize(
    "dim,parts,raw,view",
    [(0, 4, False, True), (1, 2, False, False), (1, 3, True, False), (0, 1, False, False)],
)
def test_written_bytes_are_the_whole_tensor(tmp_path, dim, parts, raw, view):
    whole = torch.randn(12, 6).to(torch.bfloat16)
    meta, storage = _save(tmp_path, whole, dim, parts, raw, view)
    out = io.BytesIO()
    ct._write_tensor(out, tmp_path, "w", meta, storage)
    assert out.getvalue() == whole.view(torch.uint8).numpy().tobytes()


def test_rows_are_copied_in_blocks_without_a_whole_tensor(tmp_path, monkeypatch):
    whole = torch.randn(64, 32)
    meta, storage = _save(tmp_path, whole, 0, 2)
    monkeypatch.setattr(ct, "_BLOCK", 1000)  # many small blocks per chunk
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(ct.torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    out = io.BytesIO()
    ct._write_tensor(out, tmp_path, "w", meta, storage)
    assert out.getvalue() == whole.numpy().tobytes()
    assert not [a for a in made if a and a[0] == whole.shape]  # never allocated the whole tensor


def test_truncated_chunk_is_one_clear_error(tmp_path):
    whole = torch.randn(8, 4)
    meta, storage = _save(tmp_path, whole, 1, 2, raw=True)
    f = tmp_path / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(LoomError, match="ends early"):
        ct._write_tensor(io.BytesIO(), tmp_path, "w", meta, storage)


def test_missing_chunk_is_named(tmp_path):
    whole = torch.randn(8, 4)
    meta, storage = _save(tmp_path, whole, 0, 2)
    meta.chunks.pop()
    with pytest.raises(LoomError, match="does not cover tensor 'w'"):
        ct._write_tensor(io.BytesIO(), tmp_path, "w", meta, storage)


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    f = tmp_path / "__0_0.distcp"
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)  # not a tensor archive: its data.pkl names builtins.print
    f.write_bytes(buf.getvalue())
    c = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [c])
    storage = {MetadataIndex("w", c.offsets): _StorageInfo(f.name, 0, len(buf.getvalue()))}
    with pytest.raises(LoomError, match="cannot be read"):
        ct._write_tensor(io.BytesIO(), tmp_path, "w", meta, storage)
