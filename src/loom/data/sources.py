"""Documents streamed from the inputs of `loom data prepare`, never all held at once.

Inputs are files or folders (searched recursively with a glob, hidden entries skipped): plain text, JSONL
(also `.jsonl.gz` and `.jsonl.zst`) and Parquet (read one row group at a time). A text file is one document
unless `text_separator` cuts it into several, or `doc_chars` cuts it into documents of about that size at
line ends. A large document is yielded in pieces (`Unit.new_doc` False for all but the first) cut at a line
end followed by a non-space character, where byte-level BPE pre-tokenizers split anyway, so the pieces
encode to the same ids as the whole text.

What goes wrong is counted in `ReadStats` (first few places named): undecodable bytes (replaced with
U+FFFD), binary files in folders (skipped), JSONL lines that are not JSON or lack the field and corrupt
compressed streams (skipped, or an error with `strict`).
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loom.errors import LoomError

BINARY_PROBE = 8192
READ_BYTES = 1 << 22  # text files are read 4 MiB at a time
PIECE_CHARS = 1 << 20  # a document longer than this is yielded in pieces of about this size
MAX_PIECE_CHARS = 1 << 26  # cut anywhere when a text has no line end for this long
KEEP = 20  # places remembered per kind of problem (the counts are exact)


@dataclass
class Unit:
    """A document, or one piece of one (`new_doc` is True for its first piece only)."""

    text: str
    new_doc: bool = True


@dataclass
class ReadStats:
    """What reading noticed; lists keep the first KEEP places, counters are exact."""

    files: int = 0
    bytes: int = 0  # input bytes read (compressed size for .gz/.zst)
    documents: int = 0
    replaced_files: int = 0  # files or lines with undecodable bytes (replaced by U+FFFD)
    replaced: list[str] = field(default_factory=list)
    skipped_binary: list[str] = field(default_factory=list)
    skipped_binary_count: int = 0
    dropped: list[str] = field(default_factory=list)  # documents with no text, as "where (why)"
    dropped_count: int = 0
    bad_lines: list[str] = field(default_factory=list)  # JSONL lines skipped, as "where (why)"
    bad_lines_count: int = 0
    corrupt: list[str] = field(default_factory=list)  # compressed files cut short by a corrupt stream
    read_once: list[str] = field(default_factory=list)  # inputs named again (directly or inside a folder)

    def note(self, kind: str, where: str) -> None:
        """Count one problem of `kind` (replaced, skipped_binary, dropped, bad_lines) at `where`."""
        items = getattr(self, kind)
        if len(items) < KEEP:
            items.append(where)
        if kind == "replaced":
            self.replaced_files += 1
        else:
            setattr(self, f"{kind}_count", getattr(self, f"{kind}_count") + 1)


@dataclass(frozen=True)
class ReadOptions:
    """How inputs become documents."""

    glob: str = "*"
    field: str = "text"  # JSONL field / Parquet column
    text_separator: str | None = None  # cut text files into documents at this string
    doc_chars: int = 0  # >0: cut text files into documents of about this many characters at line ends
    strict: bool = False  # a bad JSONL line or a corrupt compressed stream is an error, not a warning
    piece_chars: int = PIECE_CHARS


def kind_of_file(path: Path) -> str:
    """jsonl, jsonl.gz, jsonl.zst, parquet or text, from the name."""
    name = path.name.lower()
    for suffix in ("jsonl.gz", "jsonl.zst", "jsonl", "parquet"):
        if name.endswith("." + suffix):
            return suffix
    return "text"


def input_files(inputs: list[str | Path], glob: str, stats: ReadStats) -> list[tuple[Path, bool]]:
    """(file, named explicitly) for every input file in a fixed order, each real file once: a file given
    twice, or beside a folder that holds it, would put the same text in train and val."""
    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise LoomError(f"input path does not exist: {', '.join(missing)}", hint="check the --input paths")
    found: list[tuple[Path, bool]] = []
    for p in paths:
        if p.is_dir():
            found += [
                (f, False)
                for f in sorted(p.rglob(glob))
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
            ]
        else:
            found.append((p, True))
    seen: dict[str, int] = {}
    out: list[tuple[Path, bool]] = []
    for f, explicit in found:
        key = os.path.realpath(f)
        if key in seen:
            stats.read_once.append(str(f))
            if explicit:  # named on its own: a binary file is an error, as when named once
                out[seen[key]] = (out[seen[key]][0], True)
            continue
        seen[key] = len(out)
        out.append((f, explicit))
    return out


class _Decoder:
    """Incremental UTF-8 decoding with replacement, remembering whether anything was replaced."""

    def __init__(self):
        self.replaced = False
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="strict")

    def decode(self, data: bytes, final: bool = False) -> str:
        try:
            return self._dec.decode(data, final)
        except UnicodeDecodeError:
            self.replaced = True
            state = self._dec.getstate()  # the pending bytes of the previous call, not yet decoded
            self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._dec.setstate(state)
            return self._dec.decode(data, final)


def _safe_cut(text: str, target: int) -> int:
    """An index near `target` just after a line end that a non-space character follows: the last one before
    it, else the first one after it (0: none)."""
    i = text.rfind("\n", 0, target)
    while i >= 0:
        if i + 1 < len(text) and not text[i + 1].isspace():
            return i + 1
        i = text.rfind("\n", 0, i)
    i = text.find("\n", target)
    while i >= 0:
        if i + 1 < len(text) and not text[i + 1].isspace():
            return i + 1
        i = text.find("\n", i + 1)
    return 0


def _pieces(blocks: Iterator[str], opts: ReadOptions) -> Iterator[Unit]:
    """Documents from a stream of text blocks: one document (in pieces), or several when cut at the
    separator or by size (`doc_chars`)."""
    sep, size = opts.text_separator, opts.doc_chars
    buf, new_doc, n_docs = "", True, 0
    for block in blocks:
        buf += block
        if sep:
            *docs, buf = buf.split(sep)
            for d in docs:
                if d:
                    yield Unit(d, True)
                    n_docs += 1
                new_doc = True
            # a separator-less run of text longer than MAX_PIECE_CHARS goes out as pieces of one document
            while len(buf) > MAX_PIECE_CHARS:
                yield Unit(buf[: opts.piece_chars], new_doc)
                buf, new_doc = buf[opts.piece_chars :], False
            continue
        limit = size or opts.piece_chars
        while len(buf) > limit + (0 if size else opts.piece_chars // 4):
            cut = _safe_cut(buf, limit)
            if not cut:
                if len(buf) < MAX_PIECE_CHARS:
                    break  # wait for a line end in the text still to come
                cut = limit
            yield Unit(buf[:cut], new_doc)
            buf, new_doc = buf[cut:], bool(size)
            n_docs += 1
    if buf or n_docs == 0:
        yield Unit(buf, new_doc)


def _read_blocks(path: Path, dec: _Decoder, stats: ReadStats, first: bytes) -> Iterator[str]:
    with open(path, "rb") as f:
        f.seek(len(first))
        data = first
        while True:
            stats.bytes += len(data)
            more = f.read(READ_BYTES)
            yield dec.decode(data, final=not more)
            if not more:
                return
            data = more


def _text_units(path: Path, explicit: bool, opts: ReadOptions, stats: ReadStats) -> Iterator[Unit]:
    with open(path, "rb") as f:
        head = f.read(READ_BYTES)
    if b"\x00" in head[:BINARY_PROBE]:
        if explicit:
            raise LoomError(f"input '{path}' looks binary (it contains NUL bytes), not text",
                            hint="give text files, folders of text files (with --glob), or JSONL")  # fmt: skip
        stats.note("skipped_binary", str(path))
        return
    stats.files += 1
    dec = _Decoder()
    empty = True
    for u in _pieces(_read_blocks(path, dec, stats, head), opts):
        if u.text:
            empty = False
            yield u
    if dec.replaced:
        stats.note("replaced", str(path))
    if empty:
        stats.note("dropped", f"{path} (empty)")


def _kind_of(value) -> str:
    """How a JSON value that is not a non-empty string reads in a message."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "empty"
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _open_jsonl(path: Path, kind: str):
    if kind == "jsonl.gz":
        return gzip.open(path, "rb")
    if kind == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise LoomError(f"reading '{path}' needs zstandard", hint="pip install 'loom[data]'") from None
        raw = open(path, "rb")  # noqa: SIM115 - closed with the reader
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")  # noqa: SIM115


_CORRUPT = (OSError, EOFError, zlib.error, ValueError)


def _bad_line(stats: ReadStats, opts: ReadOptions, where: str, why: str, hint: str | None = None) -> None:
    if opts.strict:
        raise LoomError(f"{where} {why}", hint=hint)
    stats.note("bad_lines", f"{where} ({why})")


def _jsonl_units(path: Path, kind: str, opts: ReadOptions, stats: ReadStats) -> Iterator[Unit]:
    stats.files += 1
    lineno = 0
    f = _open_jsonl(path, kind)
    try:
        it = iter(f)
        while True:
            try:
                raw = next(it)
            except StopIteration:
                break
            except _CORRUPT as e:
                what = f"'{path}' is corrupt after line {lineno} ({type(e).__name__}: {e})"
                if opts.strict:
                    raise LoomError(
                        what, hint="replace the file, or drop --strict to keep the lines before it"
                    ) from None
                stats.corrupt.append(what)
                break
            lineno += 1
            stats.bytes += len(raw)
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8", errors="replace"))
            except json.JSONDecodeError as e:
                _bad_line(stats, opts, f"{path}:{lineno}", f"is not valid JSON: {e.msg}")
                continue
            if not isinstance(rec, dict) or opts.field not in rec:
                _bad_line(stats, opts, f"{path}:{lineno}", f"has no field '{opts.field}'",
                          hint="name the text field with --jsonl-field")  # fmt: skip
                continue
            text = rec[opts.field]
            if isinstance(text, str) and text:
                # JSON may escape lone surrogates (\ud800) that no encoder accepts: replace them.
                clean = text.encode("utf-8", errors="replace").decode("utf-8")
                if clean != text:
                    stats.note("replaced", f"{path}:{lineno}")
                yield from _split_text(clean, opts)
            else:
                stats.note("dropped", f"{path}:{lineno} ('{opts.field}' is {_kind_of(text)})")
    finally:
        f.close()


def _split_text(text: str, opts: ReadOptions) -> Iterator[Unit]:
    """One record's text as one document, in pieces when it is long."""
    if len(text) <= opts.piece_chars * 2:
        yield Unit(text, True)
        return
    yield from _pieces(iter([text]), ReadOptions(piece_chars=opts.piece_chars))


def _parquet_units(path: Path, opts: ReadOptions, stats: ReadStats) -> Iterator[Unit]:
    """One document per non-empty string of the text column, read one row group at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise LoomError(f"reading '{path}' needs pyarrow", hint="pip install 'loom[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError for a file that is not Parquet
        raise LoomError(f"'{path}' is not a readable Parquet file: {e}") from None
    if opts.field not in names:
        raise LoomError(f"'{path}' has no column '{opts.field}' (columns: {', '.join(names)})",
                        hint="name the text column with --jsonl-field")  # fmt: skip
    stats.files += 1
    row = 0
    for g in range(pf.num_row_groups):  # one row group at a time (iter_batches held more: 448 vs 394 MB)
        try:
            values = pf.read_row_group(g, columns=[opts.field]).column(0).to_pylist()
        except Exception as e:
            raise LoomError(f"'{path}' row group {g} cannot be read: {e}") from None
        stats.bytes += pf.metadata.row_group(g).total_byte_size
        for v in values:
            if isinstance(v, str) and v:
                yield from _split_text(v, opts)
            else:
                stats.note("dropped", f"{path} row {row} ('{opts.field}' is not a non-empty string)")
            row += 1
        del values


def iter_units(files: list[tuple[Path, bool]], opts: ReadOptions, stats: ReadStats) -> Iterator[Unit]:
    """Every document (or piece) of every input file, in order."""
    for f, explicit in files:
        kind = kind_of_file(f)
        if kind == "parquet":
            units = _parquet_units(f, opts, stats)
        elif kind.startswith("jsonl"):
            units = _jsonl_units(f, kind, opts, stats)
        else:
            units = _text_units(f, explicit, opts, stats)
        for u in units:
            stats.documents += u.new_doc
            yield u


def estimated_bytes(files: list[tuple[Path, bool]]) -> int:
    """The text a list of files holds, roughly: file sizes, compressed ones counted 4x (for ETAs, sampling)."""
    total = 0
    for f, _ in files:
        size = f.stat().st_size
        total += size * 4 if kind_of_file(f) in ("jsonl.gz", "jsonl.zst", "parquet") else size
    return total
