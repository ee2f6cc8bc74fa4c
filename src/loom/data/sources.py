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
            raise LoomError(
                f"input '{path}' looks binary (it contains NUL bytes), not text",
                hint="give text files, folders of text files (with --glob), or JSONL",
            )
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


_MAGIC = {"jsonl.gz": (b"\x1f\x8b", "gzip"), "jsonl.zst": (b"\x28\xb5\x2f\xfd", "zstandard")}


def _check_compressed(path: Path, kind: str) -> None:
    """A .jsonl.gz / .jsonl.zst that does not start with its format's magic bytes is refused by name (it
    would otherwise read as a corrupt stream with no lines, and the corpus as empty)."""
    magic, name = _MAGIC[kind]
    with open(path, "rb") as f:
        head = f.read(len(magic))
    if head and head != magic:
        raise LoomError(
            f"'{path}' is not {name}-compressed (it starts with {head!r}, not {name}'s {magic!r})",
            hint=f"a file named .{kind} must be {name}-compressed; name a plain JSONL file .jsonl",
        )


def open_jsonl(path: Path, kind: str):
    """A JSONL file (kind: jsonl, jsonl.gz or jsonl.zst) opened to be read as lines of bytes, decompressed;
    one named .gz / .zst that is not compressed is refused by name."""
    if kind in _MAGIC:
        _check_compressed(path, kind)
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


def corrupt_errors(kind: str) -> tuple[type[BaseException], ...]:
    """What reading a broken stream of this kind raises (zstandard's own ZstdError is none of _CORRUPT)."""
    if kind == "jsonl.zst":
        import zstandard

        return (*_CORRUPT, zstandard.ZstdError)
    return _CORRUPT


def _bad_line(stats: ReadStats, opts: ReadOptions, where: str, why: str, hint: str | None = None) -> None:
    if opts.strict:
        raise LoomError(f"{where} {why}", hint=hint)
    stats.note("bad_lines", f"{where} ({why})")


_MISSING = object()


def field_value(rec, name: str):
    """rec[name]; for a dotted name that is not a key, the value at that path of nested objects ('meta.text');
    _MISSING when there is none."""
    if isinstance(rec, dict) and name in rec:
        return rec[name]
    value = rec
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _text_paths(value, prefix: str = "") -> list[str]:
    """The (dotted) names of the non-empty strings inside a JSON object, in order: what --jsonl-field could be."""
    if isinstance(value, str) and value and prefix:
        return [prefix]
    if not isinstance(value, dict):
        return []
    return [p for k, v in value.items() for p in _text_paths(v, f"{prefix}.{k}" if prefix else str(k))]


@dataclass
class _FieldSeen:
    """What one JSONL file's lines held under --jsonl-field, to name the cause when none held text."""

    texts: int = 0
    records: int = 0
    missing: int = 0
    first: object = None  # the first record
    not_text: str | None = None  # the first value that was neither text nor empty / null: its kind, line
    not_text_value: object = None
    not_text_line: int = 0

    def check(self, path: Path, name: str) -> None:
        """Refuse a file none of whose lines has text under `name` for a reason the user can fix: the field
        is in no line, or it holds objects, lists or numbers (lines of null or "" stay dropped documents)."""
        if self.texts or not self.records:
            return
        if self.missing == self.records:
            first = self.first if isinstance(self.first, dict) else {}
            keys = ", ".join(map(str, list(first)[:8])) or "none"
            names = _text_paths(first)
            raise LoomError(
                f"none of the {self.records:,} JSON line(s) of '{path}' has the field '{name}' (the first "
                f"line's fields: {keys})",
                hint="name the text field with --jsonl-field"
                + (f" (the first line has text under: {', '.join(names[:4])})" if names else ""),
            )
        if self.not_text is not None:
            inside = _text_paths(self.not_text_value, name)
            raise LoomError(
                f"no line of '{path}' has text under '{name}': it holds {self.not_text} "
                f"(first on line {self.not_text_line})",
                hint=f"name a text field inside it with --jsonl-field: {', '.join(inside[:4])}"
                if inside
                else "name the field that holds the text with --jsonl-field",
            )


def _jsonl_units(path: Path, kind: str, opts: ReadOptions, stats: ReadStats) -> Iterator[Unit]:
    stats.files += 1
    lineno = 0
    seen = _FieldSeen()
    f = open_jsonl(path, kind)
    corrupt = corrupt_errors(kind)
    try:
        it = iter(f)
        while True:
            try:
                raw = next(it)
            except StopIteration:
                break
            except corrupt as e:
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
            seen.records += 1
            if seen.first is None:
                seen.first = rec
            text = field_value(rec, opts.field)
            if text is _MISSING:
                seen.missing += 1
                _bad_line(
                    stats,
                    opts,
                    f"{path}:{lineno}",
                    f"has no field '{opts.field}'",
                    hint="name the text field with --jsonl-field",
                )
                continue
            if isinstance(text, str) and text:
                seen.texts += 1
                # JSON may escape lone surrogates (\ud800) that no encoder accepts: replace them.
                clean = text.encode("utf-8", errors="replace").decode("utf-8")
                if clean != text:
                    stats.note("replaced", f"{path}:{lineno}")
                yield from _split_text(clean, opts)
            else:
                if seen.not_text is None and text is not None and text != "":
                    seen.not_text, seen.not_text_value, seen.not_text_line = _kind_of(text), text, lineno
                stats.note("dropped", f"{path}:{lineno} ('{opts.field}' is {_kind_of(text)})")
    finally:
        f.close()
    seen.check(path, opts.field)


def _split_text(text: str, opts: ReadOptions) -> Iterator[Unit]:
    """One record's text as one document, in pieces when it is long."""
    if len(text) <= opts.piece_chars * 2:
        yield Unit(text, True)
        return
    yield from _pieces(iter([text]), ReadOptions(piece_chars=opts.piece_chars))


def open_parquet(path: Path):
    """pyarrow's ParquetFile of `path` (nothing read yet but its footer), or one error: pyarrow missing (the
    extra to install), or a file that is not Parquet."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise LoomError(f"reading '{path}' needs pyarrow", hint="pip install 'loom[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
        pf.schema_arrow  # noqa: B018 (read here: a damaged footer fails now, as one error)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError for a file that is not Parquet
        raise LoomError(f"'{path}' is not a readable Parquet file: {e}") from None
    return pf


def _parquet_units(path: Path, opts: ReadOptions, stats: ReadStats) -> Iterator[Unit]:
    """One document per non-empty string of the text column, read one row group at a time."""
    pf = open_parquet(path)
    top, inner = parquet_text_column(pf.schema_arrow, opts.field, path)
    stats.files += 1
    row = 0
    for g in range(pf.num_row_groups):  # one row group at a time (iter_batches held more: 448 vs 394 MB)
        try:
            values = pf.read_row_group(g, columns=[top]).column(0).to_pylist()
        except Exception as e:
            raise LoomError(f"'{path}' row group {g} cannot be read: {e}") from None
        stats.bytes += pf.metadata.row_group(g).total_byte_size
        if inner:  # a field of a struct column ('meta.text')
            values = [field_value(v, inner) for v in values]
        for v in values:
            if isinstance(v, str) and v:
                yield from _split_text(v, opts)
            else:
                stats.note("dropped", f"{path} row {row} ('{opts.field}' is not a non-empty string)")
            row += 1
        del values


def _string_type(t) -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return (
        pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)
    )


def _string_columns(schema) -> list[str]:
    """The (dotted, for fields of struct columns) names of a Parquet schema's text columns."""
    import pyarrow as pa

    out: list[str] = []

    def walk(name: str, t) -> None:
        if _string_type(t):
            out.append(name)
        elif pa.types.is_struct(t):
            for i in range(t.num_fields):
                walk(f"{name}.{t.field(i).name}", t.field(i).type)

    for f in schema:
        walk(f.name, f.type)
    return out


def parquet_text_column(schema, name: str, path: Path) -> tuple[str, str]:
    """(top-level column, dotted path inside it or '') of the text column `name` of a Parquet schema: a
    column, or a field of a struct column ('meta.text'). Refuses a missing column and one that is not text
    (numbers, a struct, lists), naming the text columns there are."""
    import pyarrow as pa

    texts = _string_columns(schema)
    hint = (
        f"name a text column with --jsonl-field: {', '.join(texts[:6])}"
        if texts
        else "this file has no text column"
    )
    if name in schema.names:
        top, inner = name, ""
    else:
        top, _, inner = name.partition(".")
        if top not in schema.names or not inner:
            raise LoomError(
                f"'{path}' has no column '{name}' (columns: {', '.join(schema.names)})", hint=hint
            )
    t = schema.field(top).type
    for part in inner.split(".") if inner else []:
        i = t.get_field_index(part) if pa.types.is_struct(t) else -1
        if i < 0:
            raise LoomError(
                f"'{path}' has no column '{name}' (columns: {', '.join(schema.names)})", hint=hint
            )
        t = t.field(i).type
    if not _string_type(t):
        raise LoomError(f"column '{name}' of '{path}' holds {t}, not text", hint=hint)
    return top, inner


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
