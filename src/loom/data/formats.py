"""Token data in the formats other trainers write, read in place and written back, registered by name.

| name     | files                                   | from                                         | documents |
|----------|-----------------------------------------|----------------------------------------------|-----------|
| llmc     | `*.bin`: 256 x int32 header + tokens    | llm.c, modded-nanogpt, loom's own shards     | no        |
| nanogpt  | `train.bin` / `val.bin`: raw uint16     | nanogpt's data/*/prepare.py (+ `meta.pkl`)   | no        |
| npy      | `*train*.npy` / `*val*.npy`: 1-D ints   | build-nanogpt's fineweb.py                   | no        |
| megatron | `PREFIX.bin` + `PREFIX.idx`             | Megatron-LM's indexed dataset                | yes       |
| parquet  | a text column (read only: prepare input)| Hugging Face datasets                        | -         |

The common in-memory form is `Tokens`: one 1-D integer stream and, where the format keeps them, document
offsets. Formats without document boundaries (llm.c, nanogpt, npy) mark documents with an end-of-text token
instead; `doc_offsets_from_eot` recovers them. Readers memory-map (`open`), so training reads a foreign
directory in place through `open_split`, with no conversion.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loom.data import megatron
from loom.data.safe_pickle import read_meta_pkl
from loom.data.shards import DTYPES as LLMC_DTYPES
from loom.data.shards import HEADER_BYTES, MAGIC, read_shard, write_ids, write_shard
from loom.errors import LoomError

SPLITS = ("train", "val")
_CHUNK = 1 << 24  # tokens per step when scanning a memory map (bounded memory)


@dataclass
class Tokens:
    """One token stream; `doc_offsets` (int64, starts at 0, ends at len(ids)) when documents are known."""

    ids: np.ndarray
    doc_offsets: np.ndarray | None = None

    def documents(self) -> list[np.ndarray]:
        """The documents as views (one document: the whole stream, when boundaries are unknown)."""
        off = self.doc_offsets if self.doc_offsets is not None else np.array([0, len(self.ids)])
        return [self.ids[a:b] for a, b in zip(off[:-1], off[1:], strict=True)]


def doc_offsets_from_eot(ids: np.ndarray, eot_id: int) -> np.ndarray:
    """Document offsets of a stream where each document starts with `eot_id` (llm.c's and loom's convention)."""
    starts = np.flatnonzero(np.asarray(ids) == eot_id)
    return np.unique(np.concatenate([[0], starts, [len(ids)]])).astype(np.int64)


def id_range(arrays: list[np.ndarray]) -> tuple[int, int] | None:
    """(min id, max id) over arrays, scanned in chunks so a memory map is never loaded whole; None if empty."""
    lo, hi = None, None
    for a in arrays:
        for i in range(0, len(a), _CHUNK):
            c = a[i : i + _CHUNK]
            cl, ch = int(c.min()), int(c.max())
            lo, hi = cl if lo is None else min(lo, cl), ch if hi is None else max(hi, ch)
    return None if lo is None else (lo, hi)


def check_ids_fit(ids: np.ndarray, dtype, target: str) -> None:
    """Refuse ids a writer's dtype cannot hold, naming the largest (or a negative) id."""
    r = id_range([ids])
    if r is None:
        return
    info = np.iinfo(dtype)
    if r[0] < max(0, info.min):
        raise LoomError(f"{target}: token id {r[0]} is negative, not a valid token id")
    if r[1] > info.max:
        raise LoomError(
            f"{target}: the largest token id, {r[1]}, does not fit in {np.dtype(dtype).name} (max {info.max})",
            hint="choose a wider --dtype (e.g. uint32 or int32) or a format that allows one",
        )


def _write_atomic(path: Path, ids: np.ndarray, dtype, npy: bool = False) -> None:
    """ids (after a .npy header when `npy`) to `path.tmp`, renamed to `path` once complete."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if npy:
            descr = np.lib.format.dtype_to_descr(np.dtype(dtype).newbyteorder("<"))
            np.lib.format.write_array_header_1_0(
                f, {"descr": descr, "fortran_order": False, "shape": (len(ids),)}
            )
        write_ids(f, ids, dtype)
    os.replace(tmp, path)


def _integer(arr: np.ndarray, path: Path, what: str) -> np.ndarray:
    if arr.ndim != 1:
        raise LoomError(
            f"'{path}' holds a {arr.ndim}-D array of shape {arr.shape}; {what} must be 1-D token ids"
        )
    if arr.dtype.kind not in "iu":
        raise LoomError(
            f"'{path}' holds {arr.dtype.name} values, not integer token ids",
            hint="token shards hold integer ids (uint16, uint32, int32, ...); convert them with astype first",
        )
    return arr


class Format(ABC):
    """One on-disk token format: how a directory names its splits, and one file's reader and writer."""

    name = ""
    suffix = ".bin"
    keeps_documents = False
    patterns: tuple[str, ...] = ()  # glob patterns in a directory; {split} is replaced

    def split_files(self, d: Path, split: str) -> list[Path]:
        found = {p for pat in self.patterns for p in d.glob(pat.format(split=split)) if p.is_file()}
        return sorted(found)

    @abstractmethod
    def open(self, path: Path) -> np.ndarray:
        """The 1-D integer ids of one file, memory-mapped where the layout allows."""

    def read(self, path: Path) -> Tokens:
        return Tokens(self.open(Path(path)))

    def default_dtype(self, max_id: int):
        return np.uint16 if max_id <= 0xFFFF else np.uint32

    @abstractmethod
    def write(self, path: Path, data: Tokens, dtype=None) -> list[Path]:
        """Write one file; returns the paths written."""

    def out_name(self, split: str, index: int) -> str:
        """The file name of shard `index` of `split` when a whole directory is written."""
        return f"{split}_{index:06d}{self.suffix}"

    def _dtype(self, data: Tokens, dtype):
        r = id_range([data.ids])
        return np.dtype(dtype if dtype is not None else self.default_dtype(r[1] if r else 0))


class LlmcFormat(Format):
    """llm.c's shards (loom's own): see loom.data.shards. loom names `train_000000.bin`, llm.c
    `fineweb_train_000001.bin` / `tiny_shakespeare_val.bin`; both are found."""

    name = "llmc"
    patterns = ("{split}_*.bin", "*_{split}*.bin")

    def open(self, path):
        return read_shard(path)

    def write(self, path, data, dtype=None):
        dt = self._dtype(data, dtype)
        versions = {np.dtype(v): k for k, v in LLMC_DTYPES.items()}
        if dt not in versions:
            raise LoomError(
                f"llm.c shards hold uint16 or uint32 tokens, not {dt.name}", hint="use --dtype uint16|uint32"
            )
        check_ids_fit(data.ids, dt, f"llm.c shard '{path}'")
        write_shard(path, data.ids, versions[dt])
        return [Path(path)]


class NanoGPTFormat(Format):
    """nanogpt's raw `train.bin` / `val.bin`: uint16 tokens, no header (its train.py reads np.uint16)."""

    name = "nanogpt"
    patterns = ("{split}.bin",)

    def open(self, path):
        path = Path(path)
        size = path.stat().st_size
        if size % 2:
            raise LoomError(f"'{path}' is {size} bytes, not a whole number of uint16 tokens (truncated?)")
        if size == 0:
            return np.zeros(0, np.uint16)
        return np.memmap(path, dtype="<u2", mode="r")

    def default_dtype(self, max_id):
        return np.uint16

    def write(self, path, data, dtype=None):
        dt = self._dtype(data, dtype)
        if dt != np.uint16:
            raise LoomError(f"nanogpt's .bin files are uint16 (its train.py hard-codes it), not {dt.name}")
        check_ids_fit(data.ids, dt, f"nanogpt file '{path}'")
        _write_atomic(Path(path), data.ids, dt)
        return [Path(path)]

    def out_name(self, split, index):
        return f"{split}.bin"


class NpyFormat(Format):
    """build-nanogpt's `np.save` shards: `edufineweb_val_000000.npy`, `edufineweb_train_000001.npy`."""

    name = "npy"
    suffix = ".npy"
    patterns = ("*{split}*.npy",)

    def split_files(self, d, split):
        return [p for p in super().split_files(d, split) if not p.name.endswith(LOSS_MASK_SUFFIX)]

    def open(self, path):
        path = Path(path)
        try:  # allow_pickle=False: an object array is refused instead of unpickled
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:  # numpy parses the header with Python's tokenizer: any error means "not .npy"
            raise LoomError(f"'{path}' is not a readable .npy token array: {type(e).__name__}: {e}") from None
        return _integer(arr, path, "npy shards")

    def write(self, path, data, dtype=None):
        dt = self._dtype(data, dtype)
        if dt.kind not in "iu":
            raise LoomError(f"--dtype {dt.name} is not an integer type")
        check_ids_fit(data.ids, dt, f"npy shard '{path}'")
        _write_atomic(Path(path), data.ids, dt, npy=True)  # the .npy header np.save writes, then the ids
        return [Path(path)]


class MegatronFormat(Format):
    """Megatron-LM's indexed dataset, `PREFIX.bin` + `PREFIX.idx` (see loom.data.megatron)."""

    name = "megatron"
    keeps_documents = True
    patterns = ("*{split}*.idx",)

    def split_files(self, d, split):
        return [megatron.bin_path(p) for p in super().split_files(d, split)]

    def open(self, path):
        return megatron.read_ids(path)  # one memory map; no per-document arrays on every rank

    def read(self, path):
        r = megatron.read(path)
        return Tokens(r.ids, r.doc_offsets)

    def default_dtype(self, max_id):
        return np.uint16 if max_id <= 0xFFFF else np.int32  # as Megatron's DType.optimal_dtype

    def write(self, path, data, dtype=None):
        dt = self._dtype(data, dtype)
        if dt.kind not in "iu" or dt not in megatron.CODES:
            raise LoomError(
                f"Megatron indexed datasets hold {', '.join(sorted(d.name for d in megatron.CODES))}"
            )
        check_ids_fit(data.ids, dt, f"Megatron dataset '{megatron.prefix(path)}'")
        off = data.doc_offsets if data.doc_offsets is not None else np.array([0, len(data.ids)], np.int64)
        return megatron.write(path, data.ids, off, dt)

    def out_name(self, split, index):
        return f"{split}_{index:06d}"  # a prefix: .bin and .idx


class ParquetFormat(Format):
    """A text column of Parquet files: read as documents for `loom data prepare`, never as tokens."""

    name = "parquet"
    suffix = ".parquet"

    def open(self, path):
        raise LoomError(
            f"'{path}' is Parquet: it holds text, not token ids",
            hint=f"tokenize it with `loom data prepare --input {path}` (the text column: --jsonl-field)",
        )

    def write(self, path, data, dtype=None):
        raise LoomError("loom writes no Parquet: it is a text input for `loom data prepare`")


FORMATS: dict[str, Format] = {
    f.name: f for f in (LlmcFormat(), NanoGPTFormat(), NpyFormat(), MegatronFormat())
}
FORMATS["parquet"] = ParquetFormat()
TOKEN_FORMATS = ("llmc", "nanogpt", "npy", "megatron")


def read_parquet_texts(path: str | Path, column: str = "text", dropped: list[int] | None = None) -> list[str]:
    """The non-empty strings of one column of a Parquet file (needs pyarrow: `pip install 'loom[parquet]'`);
    the rows of other values (null, numbers, empty strings) are appended to `dropped` when it is given."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise LoomError(f"reading '{path}' needs pyarrow", hint="pip install 'loom[parquet]'") from None
    from loom.data.sources import field_value, parquet_text_column

    try:
        top, inner = parquet_text_column(pq.read_schema(path), column, path)  # a text column, or refused
        values = pq.read_table(path, columns=[top]).column(top).to_pylist()
        if inner:
            values = [field_value(v, inner) for v in values]
    except LoomError:
        raise
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError for a file that is not Parquet
        raise LoomError(f"'{path}' is not a readable Parquet file: {e}") from None
    if dropped is not None:
        dropped += [i for i, v in enumerate(values) if not (isinstance(v, str) and v)]
    return [v for v in values if isinstance(v, str) and v]


def _has_llmc_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int(np.frombuffer(head, "<i4")[0]) == MAGIC


def _nanogpt_evidence(p: Path) -> bool:
    """A headerless .bin is taken for nanogpt's raw uint16 tokens only with evidence: its names (train.bin,
    val.bin) or its vocabulary beside it (meta.pkl, or a meta.json of format nanogpt)."""
    if p.name in ("train.bin", "val.bin") or (p.parent / "meta.pkl").is_file():
        return True
    try:
        return json.loads((p.parent / "meta.json").read_text(encoding="utf-8")).get("format") == "nanogpt"
    except (OSError, ValueError, AttributeError):
        return False


def detect_file(path: str | Path, option: str = "--from") -> str:
    """The format of one file (a Megatron prefix may be given without suffix); `option` is the command's
    option that names a format (convert's --from, inspect's --format)."""
    p = Path(path)
    if p.suffix == ".parquet":
        return "parquet"
    if p.suffix == ".npy":
        return "npy"
    if p.suffix == ".idx" or megatron.idx_path(p).is_file():
        return "megatron"
    if not p.is_file():
        raise LoomError(f"'{p}' is not a regular file" if p.exists() else f"'{p}' does not exist")
    if p.stat().st_size >= HEADER_BYTES and _has_llmc_magic(p):
        return "llmc"
    if p.suffix == ".bin" and _nanogpt_evidence(p):
        return "nanogpt"
    if p.suffix == ".bin":
        raise LoomError(
            f"'{p}' is not a token file loom knows: it has no llm.c header, and a nanogpt raw .bin is named "
            "train.bin / val.bin or has its meta.pkl beside it",
            hint=f"if it holds raw uint16 token ids, say so with {option} nanogpt",
        )
    raise LoomError(
        f"cannot tell the format of '{p}'", hint=f"name it with {option} ({', '.join(TOKEN_FORMATS)})"
    )


LOSS_MASK_SUFFIX = (
    ".mask.npy"  # chat data's loss masks beside its shards (loom.data.chat_prepare): not token files
)


def _npy_files(d: Path) -> list[Path]:
    """The .npy token files of a directory (loss masks left out)."""
    return sorted(p for p in d.glob("*.npy") if p.is_file() and not p.name.endswith(LOSS_MASK_SUFFIX))


def _check_one_format(d: Path) -> None:
    """Refuse a directory holding token files of two formats (llm.c / nanogpt .bin, .npy, Megatron .idx):
    training and conversion would read one of them and silently leave the other out."""
    idx = sorted(p for p in d.glob("*.idx") if p.is_file())
    partners = {megatron.bin_path(p) for p in idx}
    kinds = {
        "Megatron .bin/.idx": idx,
        ".npy": _npy_files(d),
        "llm.c/nanoGPT .bin": sorted(p for p in d.glob("*.bin") if p.is_file() and p not in partners),
    }
    present = {k: v for k, v in kinds.items() if v}
    if len(present) > 1:
        what = "; ".join(
            f"{k}: {', '.join(p.name for p in v[:3])}{' ...' if len(v) > 3 else ''}"
            for k, v in present.items()
        )
        raise LoomError(
            f"data directory '{d}' holds token files of {len(present)} formats ({what}): loom would read one "
            "format and leave the others out",
            hint="keep one format per directory: move the other files out (`loom data convert` turns one "
            "format into another)",
        )


def detect_dir(data_dir: str | Path) -> str | None:
    """The token format of a directory, from the files in it (None when there are none loom knows); a
    directory holding two formats is refused."""
    d = Path(data_dir)
    _check_one_format(d)
    if any(d.glob("*.idx")):
        return "megatron"
    if _npy_files(d):
        return "npy"
    for name in ("train.bin", "val.bin"):
        if (d / name).is_file():
            p = d / name
            return "llmc" if p.stat().st_size >= HEADER_BYTES and _has_llmc_magic(p) else "nanogpt"
    return "llmc" if any(d.glob("*.bin")) else None


def split_files(data_dir: str | Path, split: str, fmt: str | None = None) -> list[Path]:
    """The files of one split of a data directory, in order: loom's prepared layout (meta.json +
    `train_*.bin`) or a foreign one (nanogpt, npy, Megatron, llm.c names), used in place."""
    d = Path(data_dir)
    if not d.is_dir():
        raise LoomError(f"data.path '{d}' is not a directory", hint="prepare one with `loom data prepare`")
    fmt = fmt or detect_dir(d)
    llmc_named = any(d.glob("*_train*.bin")) or any(d.glob("*_val*.bin"))
    if fmt is None or (fmt == "llmc" and not llmc_named and not (d / "meta.json").is_file()):
        raise LoomError(
            f"data.path '{d}' is not a prepared data directory (no meta.json)",
            hint="run `loom data prepare --input ... --out DIR` and point data.path at DIR (or use a nanogpt, "
            "build-nanogpt .npy, Megatron or llm.c directory: see `loom data inspect`)",
        )
    f = FORMATS[fmt]
    paths = f.split_files(d, split)
    if not paths:
        pats = " or ".join(p.format(split=split) for p in f.patterns)
        raise LoomError(f"data directory '{d}' has no {split} shards ({pats})")
    return paths


def open_split(data_dir: str | Path, split: str) -> list[np.ndarray]:
    """One 1-D integer array per shard of a split (memory-mapped where possible), in any known format."""
    fmt = detect_dir(data_dir)
    return [FORMATS[fmt or "llmc"].open(p) for p in split_files(data_dir, split, fmt)]


def _nanogpt_vocab(raw: dict, source: Path) -> dict:
    """loom's meta for a nanogpt vocabulary {'vocab_size', 'itos', 'stoi'} (a char tokenizer when itos is
    a full table). The vocabulary gets one more id, loom's end-of-text, which samples start from."""
    vocab = raw.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise LoomError(f"'{source}' has no positive integer vocab_size")
    tokenizer, itos = None, raw.get("itos")
    if isinstance(itos, dict) and itos:
        try:
            table = {int(k): v for k, v in itos.items()}  # JSON keys are strings
        except (TypeError, ValueError):
            table = {}
        if sorted(table) == list(range(len(table))) and all(isinstance(v, str) for v in table.values()):
            chars = [table[i] for i in range(len(table))]
            # no eot_id: nanogpt's data has no end-of-text token (loom's CharTokenizer adds one, unused)
            tokenizer = {"kind": "char", "chars": chars, "source": source.name}
    size = max(vocab, len(tokenizer["chars"]) + 1) if tokenizer else vocab
    return {
        "format": "nanogpt",
        "vocab_size": size,
        "nanogpt_vocab_size": vocab,
        "tokenizer": tokenizer,
        "vocab_from": source.name,
    }


def read_meta(data_dir: str | Path) -> dict:
    """A data directory's meta: loom's meta.json; nanogpt's meta.pkl (parsed, never unpickled) or the same
    vocabulary as meta.json; otherwise {vocab_size: max id + 1, tokenizer: None} from a scan of the ids."""
    d = Path(data_dir)
    path = d / "meta.json"
    if path.is_file():
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LoomError(f"cannot read '{path}': {e}", hint="prepare the data again") from None
        if isinstance(meta, dict) and "itos" in meta:
            return _nanogpt_vocab(meta, path)
        vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
        if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
            raise LoomError(
                f"'{path}' is not a loom meta.json (no positive integer vocab_size)",
                hint="prepare the data again with `loom data prepare`",
            )
        return meta
    if (d / "meta.pkl").is_file():
        return _nanogpt_vocab(read_meta_pkl(d / "meta.pkl"), d / "meta.pkl")
    fmt = detect_dir(d)
    arrays = [a for s in SPLITS if FORMATS[fmt or "llmc"].split_files(d, s) for a in open_split(d, s)]
    # No scan of every token at start: the start of each shard, _ID_CHECK_TOKENS in all (exact for small
    # data). `loom data inspect --write-meta DIR` scans once and records the vocabulary in meta.json.
    per_shard = max(1, _ID_CHECK_TOKENS // max(1, len(arrays)))
    r = id_range([a[:per_shard] for a in arrays]) if arrays else None
    if r is None:
        open_split(d, "train")  # raises the reason there is nothing to read
        raise LoomError(f"data directory '{d}' holds no tokens")
    whole = all(len(a) <= per_shard for a in arrays)
    return {
        "format": fmt,
        "vocab_size": r[1] + 1,
        "tokenizer": None,
        "vocab_from": "max id + 1" if whole else "max id + 1 of each shard's start",
    }


_ID_CHECK_TOKENS = 1 << 24  # ids checked against the vocabulary before training, over all shards


def check_ids_below_vocab(data_dir: str | Path, vocab_size: int, arrays: dict[str, list[np.ndarray]]) -> None:
    """Refuse ids that the meta's vocabulary does not hold (a meta.json that belongs to other shards), which
    would index past the embedding. Every shard is checked from its start, up to _ID_CHECK_TOKENS in all, so
    that starting a run on billions of tokens stays cheap."""
    shards = [(s, i, a) for s, arrs in arrays.items() for i, a in enumerate(arrs)]
    per_shard = max(1, _ID_CHECK_TOKENS // max(1, len(shards)))
    for split, i, a in shards:
        r = id_range([a[:per_shard]])
        if r is not None and (r[1] >= vocab_size or r[0] < 0):
            bad = r[1] if r[1] >= vocab_size else r[0]
            raise LoomError(
                f"data directory '{data_dir}': {split} shard {i} holds token id {bad}, outside the vocabulary "
                f"of {vocab_size} ids its meta says it has",
                hint="the meta.json (or meta.pkl) does not belong to these shards: prepare the data again",
            )


def check_dir(data_dir: str | Path) -> dict:
    """Open every shard of both splits (headers, sizes, dtypes checked), check that the ids fit the
    vocabulary, and return the directory's meta."""
    arrays = {split: open_split(data_dir, split) for split in SPLITS}
    meta = read_meta(data_dir)
    if not str(meta.get("vocab_from", "")).startswith("max id + 1"):  # read from meta.json / meta.pkl
        check_ids_below_vocab(data_dir, int(meta["vocab_size"]), arrays)
    return meta
