"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read memory-mapped and written.

Layout, as in NVIDIA/Megatron-LM megatron/core/datasets/indexed_dataset.py (`_IndexWriter.write`,
`_IndexReader.__init__`, `IndexedDatasetBuilder`), all little-endian:

    .idx  b"MMIDIDX\\x00\\x00"            9-byte magic (_INDEX_HEADER)
          <Q version = 1
          <B dtype code                   DType: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                                 6 float64, 7 float32, 8 uint16
          <Q sequence count S
          <Q document count D             = number of documents + 1
          int32[S]  sequence lengths      tokens per sequence
          int64[S]  sequence pointers     byte offset of each sequence in .bin
          int64[D]  document indices      sequence index where each document ends, starting with 0
          (int8[S]  sequence modes, multimodal datasets only)
    .bin  the sequences' tokens, back to back, in the dtype

A document is the run of sequences between two document indices. loom writes one sequence per document
(Megatron's preprocess_data.py without sentence splitting) and a trailing document index of S.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loom.data.shards import write_ids
from loom.errors import LoomError

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count = 34
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def prefix(path: str | Path) -> Path:
    """The dataset prefix of `p`, `p.bin` or `p.idx`."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def idx_path(path: str | Path) -> Path:
    p = prefix(path)
    return p.with_name(p.name + ".idx")


def bin_path(path: str | Path) -> Path:
    p = prefix(path)
    return p.with_name(p.name + ".bin")


@dataclass
class Indexed:
    """A dataset read back: the token stream, document offsets in tokens, and the raw index counts."""

    ids: np.ndarray
    doc_offsets: np.ndarray
    sequences: int
    dtype_code: int


def _array(path: Path, dtype: str, count: int, offset: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def read_index(path: str | Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray, int]:
    """Validate an .idx file; (token dtype, lengths, pointers, document indices, dtype code)."""
    idx = idx_path(path)
    if not idx.is_file():
        raise LoomError(f"Megatron index '{idx}' is missing (a dataset is PREFIX.bin + PREFIX.idx)")
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head.startswith(MAGIC) and not (len(head) < len(MAGIC) and MAGIC.startswith(head)):
        raise LoomError(
            f"'{idx}' does not start with Megatron's index magic {MAGIC!r}: not a Megatron .idx file",
            hint="give the PREFIX of a Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx), or check --from",
        )
    if size < HEADER_BYTES:
        raise LoomError(
            f"Megatron index '{idx}' is {size} bytes, shorter than its {HEADER_BYTES}-byte header (truncated)"
        )
    (version,) = struct.unpack_from("<Q", head, 9)
    code = head[17]
    n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
    if version != 1:
        raise LoomError(f"Megatron index '{idx}' has version {version}; loom reads version 1")
    if code not in DTYPES:
        raise LoomError(f"Megatron index '{idx}' has unknown dtype code {code} (known: 1-8)")
    dtype = np.dtype(DTYPES[code])
    if dtype.kind == "f":
        raise LoomError(f"Megatron dataset '{prefix(idx)}' holds {dtype.name} values, not integer token ids")
    need = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if size < need:
        raise LoomError(
            f"Megatron index '{idx}' is {size} bytes but its header ({n_seq} sequences, {n_doc} document "
            f"indices) needs {need} (truncated)",
            hint="the index is truncated or corrupt: write the dataset again",
        )
    lengths = _array(idx, "<i4", n_seq, HEADER_BYTES)
    pointers = _array(idx, "<i8", n_seq, HEADER_BYTES + 4 * n_seq)
    docs = _array(idx, "<i8", n_doc, HEADER_BYTES + 12 * n_seq)
    if n_doc and (docs[0] != 0 or docs[-1] > n_seq or np.any(np.diff(docs) < 0)):
        raise LoomError(
            f"Megatron index '{idx}' has document indices out of order or past its {n_seq} sequences"
        )
    return dtype, lengths, pointers, docs, code


def read(path: str | Path) -> Indexed:
    """Memory-map a dataset's tokens (one stream) after checking the .bin holds what the .idx says."""
    dtype, lengths, pointers, docs, code = read_index(path)
    binp = bin_path(path)
    if not binp.is_file():
        raise LoomError(f"Megatron data file '{binp}' is missing (a dataset is PREFIX.bin + PREFIX.idx)")
    item = dtype.itemsize
    seq_off = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    total = int(seq_off[-1])
    end = int((pointers + lengths.astype(np.int64) * item).max()) if len(lengths) else 0
    size = binp.stat().st_size
    if size < end:
        raise LoomError(
            f"Megatron data file '{binp}' is {size} bytes but its index points up to byte {end} (truncated)",
            hint="the .bin is truncated or corrupt: write the dataset again",
        )
    contiguous = np.array_equal(pointers, seq_off[:-1] * item)
    if contiguous:
        ids = _array(binp, dtype.newbyteorder("<").str, total, 0)
    else:  # sequences stored out of order: gather them (Megatron's own writers never do this)
        raw = np.memmap(binp, dtype=np.uint8, mode="r")
        ids = np.concatenate(
            [np.frombuffer(raw, dtype, int(n), int(p)) for p, n in zip(pointers, lengths, strict=True)]
            or [np.zeros(0, dtype)]
        )
    bounds = docs if len(docs) else np.array([0], np.int64)
    doc_offsets = seq_off[np.asarray(bounds, np.int64)]
    if doc_offsets[-1] != total:  # sequences after the last end_document(): one more document
        doc_offsets = np.concatenate([doc_offsets, [total]])
    return Indexed(ids, doc_offsets.astype(np.int64), len(lengths), code)


def read_ids(path: str | Path) -> np.ndarray:
    """Memory-map a dataset's tokens for training without building document-count-sized arrays: when the
    sequences are stored in order (as Megatron's writers store them: first at 0, last ending at the sum of
    the lengths, the .bin that long) the ids are one memory map; otherwise `read` gathers them."""
    dtype, lengths, pointers, _, _ = read_index(path)
    binp = bin_path(path)
    if not len(lengths) or not binp.is_file():
        return read(path).ids
    item = dtype.itemsize
    total = int(lengths.sum(dtype=np.int64))
    last = int(pointers[-1]) + int(lengths[-1]) * item
    if int(pointers[0]) != 0 or last != total * item or binp.stat().st_size < last:
        return read(path).ids
    return _array(binp, dtype.newbyteorder("<").str, total, 0)


def write(path: str | Path, ids: np.ndarray, doc_offsets: np.ndarray, dtype) -> list[Path]:
    """Write PREFIX.bin and PREFIX.idx: one sequence per document, tokens as `dtype` (one of DTYPES)."""
    dtype = np.dtype(dtype)
    lengths = np.diff(np.asarray(doc_offsets, np.int64))
    if len(lengths) and lengths.max() > np.iinfo(np.int32).max:
        raise LoomError("a document has more than 2**31 - 1 tokens: Megatron stores lengths as int32")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * dtype.itemsize
    header = MAGIC + struct.pack("<QBQQ", 1, CODES[dtype], len(lengths), len(lengths) + 1)
    binp, idxp = bin_path(path), idx_path(path)
    for p in (binp, idxp):
        with open(p.with_name(p.name + ".tmp"), "wb") as f:
            if p is binp:
                write_ids(f, ids, dtype)
            else:
                f.write(header)
                for arr, dt in ((lengths, "<i4"), (pointers, "<i8"), (np.arange(len(lengths) + 1), "<i8")):
                    f.write(arr.astype(dt).tobytes())
    for p in (binp, idxp):  # both complete before either replaces an old file
        os.replace(p.with_name(p.name + ".tmp"), p)
    return [binp, idxp]
