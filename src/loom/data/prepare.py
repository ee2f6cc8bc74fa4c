"""`loom data prepare`: text files, folders, JSONL (.gz, .zst) or Parquet -> tokenizer -> train/val token
shards + meta.json, streamed with bounded memory.

Documents flow from the inputs (loom.data.sources) through the train/val split (loom.data.split) to a pool
of worker processes (loom.data.encode) and into fixed-size shards written as they fill (ShardWriter). Peak
memory does not grow with the corpus: at most one split window of documents, a few chunks in flight and the
tokenizer's training sample are held.

Everything is written into `.<out>.loom-tmp` beside the output and renamed at the end. Shards are committed
one by one with a progress record (progress.json); run the same command again after an interruption and it
continues from the last complete shard, giving the same bytes as an uninterrupted run. A different
preparation in the way is refused unless --force.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loom import __version__, log
from loom.data.encode import SPLITS, choose_backend, cpu_count, encode_chunks, tiktoken_spec
from loom.data.shards import DTYPES, ShardWriter, read_header, version_for_vocab
from loom.data.sources import (
    ReadOptions,
    ReadStats,
    estimated_bytes,
    input_files,
    iter_units,
    kind_of_file,
)
from loom.data.split import Splitter, check_split, split_documents  # noqa: F401 (split_documents: re-export)
from loom.data.tokenizers import (
    CharTokenizer,
    HFTokenizer,
    check_bpe_vocab,
    load_given_tokenizer,
    tokenizer_files,
    tokenizer_hash,
)
from loom.env import cpu_memory_release
from loom.errors import LoomError
from loom.outputs import check_apart, check_replaceable, replace_output, write_marker

SHARD_TOKENS = 100_000_000  # llm.c's shard size
CHUNK_CHARS = 1 << 20  # characters per encoding task
TOKENIZER_SAMPLE = 200_000_000  # characters of train text a BPE is trained on (at most)
DOC_CAP = 10_000  # characters of one document that go into the tokenizer's sample (nanochat's cap)
REPEAT_CHECK_DOCS = 1_000_000  # repeated documents are looked for among the first this many
PROGRESS = "progress.json"


def _check_not_empty(found: bool, inputs, stats: ReadStats, glob: str | None = None) -> None:
    """Refuse an empty corpus with what reading met on the way (binary files, documents with no text, JSONL
    lines skipped, corrupt files): the real cause, not only "empty"."""
    if found:
        return
    where = ", ".join(str(p) for p in inputs)
    if glob is not None:  # no input file at all
        raise LoomError(
            f"the corpus is empty: no file in {where} matches --glob '{glob}'",
            hint="check --input and --glob (folders are searched recursively; hidden entries skipped)",
        )
    n = stats.skipped_binary_count
    reasons = [f"{n} binary files skipped ({_some(stats.skipped_binary, 3, n)})"] if n else []
    if stats.dropped_count:
        reasons.append(
            f"{stats.dropped_count} document(s) with no text: {_some(stats.dropped, 3, stats.dropped_count)}"
        )
    if stats.bad_lines_count:
        reasons.append(
            f"{stats.bad_lines_count} JSONL line(s) skipped: {_some(stats.bad_lines, 3, stats.bad_lines_count)}"
        )
    reasons += stats.corrupt[:3]
    hint = "check --input and --glob"
    if stats.bad_lines_count:
        hint = (
            "fix those lines, or name the text field with --jsonl-field; --strict stops at the first bad line"
        )
    elif stats.corrupt:
        hint = "replace the corrupt file(s)"
    raise LoomError(
        f"the corpus is empty: no text found in {where}" + (f"; {'; '.join(reasons)}" if reasons else ""),
        hint=hint,
    )


def _some(items: list[str], n: int = 3, total: int | None = None) -> str:
    """The first n items, and how many more."""
    total = len(items) if total is None else total
    more = f" and {total - n} more" if total > n else ""
    return ", ".join(items[:n]) + more


def report_stats(stats: ReadStats, repeats: int = 0) -> None:
    """Warn about everything reading noticed, naming the first few places."""
    notes = [  # (how many, the first places, how many to name, the message before them)
        (
            len(stats.read_once),
            stats.read_once,
            3,
            "{} input file(s) were named more than once (directly or inside a folder) and are read once",
        ),
        (
            stats.replaced_files,
            stats.replaced,
            3,
            "{} file(s) or line(s) had undecodable bytes, replaced with U+FFFD",
        ),
        (stats.skipped_binary_count, stats.skipped_binary, 3, "skipped {} binary file(s)"),
        (stats.dropped_count, stats.dropped, 5, "dropped {} document(s) with no text"),
        (
            stats.bad_lines_count,
            stats.bad_lines,
            5,
            "skipped {} JSONL line(s) (--strict makes this an error)",
        ),
    ]
    for count, places, n, message in notes:
        if count:
            log.warn(f"{message.format(count)}: {_some(places, n, count)}")
    for what in stats.corrupt:
        log.warn(f"{what}: the rest of that file is skipped (--strict makes this an error)")
    if repeats:
        log.warn(
            f"{repeats} document(s) repeat the text of an earlier one: with the docs split a copy can land "
            "in val while its original trains, which makes the val loss too low"
        )


def encoder_spec(tok, dtype=np.int64) -> dict:
    """What a worker process needs to rebuild the tokenizer (picklable)."""
    spec = {"kind": tok.kind, "eot_id": tok.eot_id, "dtype": np.dtype(dtype).str}
    if isinstance(tok, CharTokenizer):
        spec["chars"] = tok.chars
    elif tok.kind == "sentencepiece":
        spec["model"] = tok.proto
    else:
        spec["json"] = tok.tok.to_str()
    return spec


# ---------------------------------------------------------------------------------------- streaming


@dataclass
class PrepareRequest:
    """The settings of one preparation; its fingerprint decides whether an unfinished one may continue."""

    inputs: list[str]
    tokenizer: str
    vocab_size: int
    val_fraction: float
    split_mode: str
    seed: int
    shard_tokens: int
    read: ReadOptions
    tokenizer_sample: int
    doc_cap: int
    pattern: str
    bpe_trainer: str
    dtype: str
    chunk_chars: int

    def fingerprint(self, files: list[tuple[Path, bool]]) -> str:
        d = {k: v for k, v in vars(self).items() if k != "read"}
        d["read"] = vars(self.read)
        # the inputs as found (names, sizes, modification times): an edited input is another preparation
        d["files"] = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f, _ in files]
        if self.tokenizer not in ("char", "bpe"):
            d["tokenizer_sha"] = [
                hashlib.sha256(f.read_bytes()).hexdigest() for f in tokenizer_files(self.tokenizer)
            ]
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def _version(vocab_size: int, dtype: str) -> int:
    """Shard version (1 = uint16, 2 = uint32) for a vocabulary; refuses a dtype too small for it."""
    if dtype == "auto":
        return version_for_vocab(vocab_size)
    version = {"uint16": 1, "uint32": 2}.get(dtype)
    if version is None:
        raise LoomError(f"unknown --dtype '{dtype}'", hint="use auto, uint16 or uint32")
    if vocab_size - 1 > np.iinfo(DTYPES[version]).max:
        raise LoomError(
            f"a vocabulary of {vocab_size:,} ids does not fit in {dtype}", hint="use --dtype uint32 (or auto)"
        )
    return version


def _check_eot_width(tok, dtype: str) -> None:
    """An end-of-text id past what --dtype holds is named as such (it opens every document: a wrapped id
    would silently write another token)."""
    version = {"uint16": 1, "uint32": 2}.get(dtype)
    if version is not None and tok.eot_id > np.iinfo(DTYPES[version]).max:
        raise LoomError(
            f"the tokenizer's end-of-text id {tok.eot_id:,} ({tok.eot}) does not fit in {dtype} shards "
            f"(at most {np.iinfo(DTYPES[version]).max:,})",
            hint="use --dtype uint32 (or auto), or give the end-of-text token a smaller id",
        )


@contextmanager
def _bar(label: str, total: int | None):
    """A progress bar with bytes read, bytes/s, tokens/s and ETA; yields update(bytes_read, tokens)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    t0 = time.perf_counter()
    cols = [
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[tps]}"),
        TimeRemainingColumn(),
    ]
    console = log.console()
    with Progress(*cols, transient=True, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total, tps="")

        def update(done: int, tokens: int = 0) -> None:
            dt = max(time.perf_counter() - t0, 1e-9)
            tps = f"{tokens / dt / 1e6:.2f}M tok/s" if tokens else ""
            bar.update(task, completed=done, total=max(total or 0, done) or None, tps=tps)

        yield update


def _units(
    plan: PrepareRequest, files, stats: ReadStats, total_chars: int | None
) -> Iterator[tuple[str, object]]:
    """(split, unit) for every document piece, in order."""
    sp = Splitter(plan.val_fraction, plan.split_mode, plan.seed, total_chars)
    for u in iter_units(files, plan.read, stats):
        yield from sp.feed(u)
    _check_not_empty(stats.documents > 0, plan.inputs, stats)
    yield from sp.finish()


def _count_chars(plan: PrepareRequest, files, label: str) -> int:
    """Characters of the whole corpus (a reading pass; the tail split needs the total first)."""
    stats, n = ReadStats(), 0
    with _bar(label, estimated_bytes(files)) as update:
        for i, u in enumerate(iter_units(files, plan.read, stats)):
            n += len(u.text)
            if i % 256 == 0:
                update(stats.bytes)
    _check_not_empty(n > 0, plan.inputs, stats)
    return n


def _train_tokenizer(plan: PrepareRequest, files, total_chars: int | None):
    """char: the characters of the whole corpus; bpe: trained on a sample of the train split (documents
    taken with a seeded probability, each capped at doc_cap characters); else the given tokenizer.json."""
    if plan.tokenizer not in ("char", "bpe"):
        tok = load_given_tokenizer(plan.tokenizer)
        return tok, "sentencepiece" if tok.kind == "sentencepiece" else "tokenizer.json"
    stats = ReadStats()
    est = estimated_bytes(files)
    if plan.tokenizer == "char":
        seen: set[str] = set()
        with _bar("reading characters", est) as update:
            for i, (_, u) in enumerate(_units(plan, files, stats, total_chars)):
                seen.update(u.text)
                if i % 256 == 0:
                    update(stats.bytes)
        return CharTokenizer(sorted(seen)), "char"
    # a corpus larger than the sample: documents taken with a seeded probability, each capped (a document
    # longer than a piece is capped per piece); a smaller one is taken whole
    keep = min(1.0, plan.tokenizer_sample / max(1, est * (1 - plan.val_fraction)))
    cap = plan.doc_cap if keep < 1.0 else float("inf")
    rng = np.random.default_rng([plan.seed, 2])
    sample: list[str] = []
    size, taking = 0, False
    with _bar("tokenizer sample", est) as update:
        for i, (split, u) in enumerate(_units(plan, files, stats, total_chars)):
            if u.new_doc:
                taking = split == "train" and bool(rng.random() < keep)
            if taking:  # a document, or one piece of a long one, capped
                piece = u.text if cap == float("inf") else u.text[:cap]
                sample.append(piece)
                size += len(piece)
            if i % 256 == 0:
                update(stats.bytes)
            if size >= plan.tokenizer_sample:
                break
    if size == 0:  # a corpus far larger than the sample: the seeded draw took no document
        raise LoomError(
            f"the BPE's training sample is empty: --tokenizer-sample {plan.tokenizer_sample:,} of "
            f"~{est:,} bytes of input took no document of the train split",
            hint="raise --tokenizer-sample (default 200,000,000 characters)",
        )
    t0 = time.perf_counter()
    tok = HFTokenizer.train(sample, plan.vocab_size, plan.pattern, plan.bpe_trainer)
    del sample
    log.info(
        f"trained a byte-level BPE ({plan.pattern} split, vocab {tok.vocab_size:,}) on a sample of "
        f"{size:,} characters in {time.perf_counter() - t0:.1f}s"
    )
    return tok, "bpe"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _start(tmp: Path, fingerprint: str, force: bool) -> dict | None:
    """The progress record of an unfinished preparation of the same settings in tmp (to continue), else
    None with tmp emptied; a different unfinished preparation is refused unless --force."""
    rec = None
    if (tmp / PROGRESS).is_file():
        try:
            rec = json.loads((tmp / PROGRESS).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            rec = None
    if rec and rec.get("fingerprint") == fingerprint:
        return rec
    if rec and not force:
        raise LoomError(
            f"'{tmp}' holds an unfinished preparation with other settings or inputs",
            hint="run that preparation's command again to finish it, or pass --force to start "
            "this one instead",
        )
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return None


# option -> (the smallest value it takes, what it is, what its smallest value means or None)
COUNTS = {
    "vocab_size": (1, "the BPE vocabulary size", None),
    "seed": (0, "the seed of the train/val split and the tokenizer sample", None),
    "shard_tokens": (1, "tokens per shard", None),
    "workers": (0, "encoding processes", "0: every usable core"),
    "tokenizer_sample": (1, "characters of train text the BPE is trained on", None),
    "doc_cap": (1, "characters of one document in the BPE's sample", None),
    "doc_chars": (0, "characters per document cut from a text file", "0: one document per file"),
}


def check_counts(**values: int) -> None:
    """The counts of `loom data prepare` refused outside their domain before anything is read (a BPE trained
    on 0 characters, a negative number of workers): one error naming the first bad option."""
    for key, value in values.items():
        low, what, zero = COUNTS[key]
        if value < low:
            option = "--" + key.replace("_", "-")
            raise LoomError(
                f"{option} must be >= {low} ({what}), got {value}",
                hint=f"{option} {zero}" if zero else f"leave {option} out for its default",
            )


def prepare(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer: str = "char",
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    split_mode: str = "docs",
    jsonl_field: str = "text",
    glob: str = "*",
    seed: int = 1337,
    force: bool = False,
    source: str | None = None,
    shard_tokens: int = SHARD_TOKENS,
    *,
    workers: int = 0,
    tokenizer_sample: int = TOKENIZER_SAMPLE,
    doc_cap: int = DOC_CAP,
    pattern: str = "gpt2",
    bpe_trainer: str = "auto",
    text_separator: str | None = None,
    doc_chars: int = 0,
    strict: bool = False,
    dtype: str = "auto",
    encoder: str = "auto",
    chunk_chars: int = CHUNK_CHARS,
) -> dict:
    """Prepare a data directory (streaming, resumable); returns its meta.json contents.

    workers: encoding processes (0: every core this process may use)."""
    out = Path(out)
    check_apart(out, inputs)
    check_replaceable(out, "data", force)  # before any reading; replaced only once the new one is ready
    check_counts(
        vocab_size=vocab_size,
        seed=seed,
        shard_tokens=shard_tokens,
        workers=workers,
        tokenizer_sample=tokenizer_sample,
        doc_cap=doc_cap,
        doc_chars=doc_chars,
    )
    _check_options(tokenizer, vocab_size, dtype, val_fraction, split_mode, chunk_chars)
    t0 = time.perf_counter()
    # blocks of 1 MiB and more (text blocks, pieces, chunks) are memory maps given back when freed: from the
    # heap, their fragmentation made peak RSS grow with the length of a single large text file
    cpu_memory_release(trim_threshold=8 << 20)
    read = ReadOptions(
        glob=glob,
        field=jsonl_field,
        text_separator=text_separator or None,
        doc_chars=doc_chars,
        strict=strict,
    )
    found = ReadStats()
    files = input_files(inputs, glob, found)
    _check_not_empty(bool(files), inputs, ReadStats(), glob)
    plan = PrepareRequest(
        [str(p) for p in inputs],
        tokenizer,
        vocab_size,
        val_fraction,
        _split_mode_of(split_mode, files, read),
        seed,
        shard_tokens,
        read,
        tokenizer_sample,
        doc_cap,
        pattern,
        bpe_trainer,
        dtype,
        chunk_chars,
    )
    tmp = out.with_name(f".{out.name}.loom-tmp")
    meta = _run_in(tmp, plan, files, force, workers or _auto_workers(files), encoder, found.read_once)
    meta.update(source=source or ", ".join(str(p) for p in inputs), loom_version=__version__)
    _publish(tmp, out, meta, force)
    _report(out, meta, val_fraction, time.perf_counter() - t0)
    return meta


def _run_in(
    tmp: Path, plan: PrepareRequest, files, force: bool, workers: int, encoder: str, read_once
) -> dict:
    """_run in tmp, continuing an unfinished preparation of the same settings there; on failure tmp is kept
    only when it holds a shard worth continuing from."""
    fingerprint = plan.fingerprint(files)
    rec = _start(tmp, fingerprint, force)
    try:
        return _run(plan, files, tmp, rec, fingerprint, workers, encoder, read_once)
    except BaseException:
        if not any(tmp.glob("*_000000.bin")):  # nothing worth continuing from
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_options(
    tokenizer: str, vocab_size: int, dtype: str, val_fraction: float, split_mode: str, chunk_chars: int
) -> None:
    """The options refused before any reading (a BPE vocabulary too large for the dtype, a missing
    tokenizer.json, a split that leaves nothing)."""
    if tokenizer == "bpe":
        check_bpe_vocab(vocab_size)
        _version(vocab_size, dtype)
    elif tokenizer != "char":
        tokenizer_files(tokenizer)
    check_split(val_fraction, split_mode)
    if chunk_chars < 1:
        raise LoomError(f"chunk_chars must be at least 1, got {chunk_chars}")


def _split_mode_of(split_mode: str, files, read: ReadOptions) -> str:
    """--split-mode docs over one text file that is one document splits its characters instead."""
    if split_mode == "docs" and len(files) == 1 and kind_of_file(files[0][0]) == "text":
        if not read.text_separator and not read.doc_chars:
            log.info("one document only: splitting its characters (train first, val last)")
            return "tail"
    return split_mode


def _publish(tmp: Path, out: Path, meta: dict, force: bool) -> None:
    """The finished preparation in tmp becomes `out` (replacing what loom wrote there before, with --force)."""
    _write_json(tmp / "meta.json", meta)
    (tmp / PROGRESS).unlink()
    write_marker(tmp, "data")
    replace_output(out, "data", force)
    os.replace(tmp, out)


def _report(out: Path, meta: dict, val_fraction: float, dt: float) -> None:
    """One line of what was prepared; a warning when val's share is far from the one asked."""
    splits = meta["splits"]
    n_tok = splits["train"]["tokens"] + splits["val"]["tokens"]
    share = splits["val"]["tokens"] / max(1, n_tok)
    log.info(
        f"prepared {out}: {meta['tokenizer']['kind']} tokenizer, vocab {meta['vocab_size']:,}, train "
        f"{splits['train']['tokens']:,} tokens ({splits['train']['documents']} docs), val "
        f"{splits['val']['tokens']:,} tokens ({share:.1%}, {splits['val']['documents']} docs), "
        f"{meta['bytes_per_token_val']:.2f} bytes/token on val, in {dt:.1f}s ({n_tok / dt / 1e6:.2f}M tokens/s)"
    )
    if abs(share - val_fraction) > max(0.02, 0.25 * val_fraction):
        log.warn(
            f"val holds {share:.1%} of the tokens, not the {val_fraction:.1%} asked by --val-fraction: the "
            f"{meta['documents']} documents are too few or too uneven to split closer by whole documents "
            "(--split-mode tail cuts at the exact share)"
        )


SMALL_INPUT = 8 << 20  # bytes of text one process encodes in a couple of seconds


def _auto_workers(files) -> int:
    """workers=0: every usable core, unless the input is small. Then one process: a pool's start (its workers
    are forks of multiprocessing's fork server: loom.data.encode) costs more than it saves."""
    return 1 if estimated_bytes(files) < SMALL_INPUT else cpu_count()


def _run(
    plan: PrepareRequest,
    files,
    tmp: Path,
    rec: dict | None,
    fingerprint: str,
    workers: int,
    encoder: str,
    read_once: list,
) -> dict:
    """Tokenizer, then every chunk encoded into shards under tmp; the core of meta.json."""
    tok, rec = _tokenizer_and_progress(plan, files, tmp, rec, fingerprint)
    _check_eot_width(tok, plan.dtype)
    version = _version(tok.vocab_size, plan.dtype)
    spec = encoder_spec(tok, DTYPES[version])
    start = {s: (v["chunk"], v["offset"]) for s, v in rec["splits"].items()}
    _drop_uncommitted(tmp, rec)

    def commit(split: str, shards: int, position) -> None:
        if position is not None:
            rec["splits"][split] = {"shards": shards, "chunk": position[0], "offset": position[1]}
            _write_json(tmp / PROGRESS, rec)

    writers = {
        s: ShardWriter(tmp, s, plan.shard_tokens, version, rec["splits"][s]["shards"], commit) for s in SPLITS
    }
    stats = ReadStats(read_once=read_once)
    counts = {"documents": {s: 0 for s in SPLITS}, "val_bytes": 0, "repeats": 0}
    resume_chunk = min(c for c, _ in start.values())
    gen = (
        c if i >= resume_chunk else None
        for i, c in enumerate(_chunks(plan, _units(plan, files, stats, rec["total_chars"]), counts))
    )
    first = next(gen)
    spec = _encoder_of(spec, rec, first, encoder, tmp)
    t0 = time.perf_counter()
    _encode_into(writers, start, encode_chunks(spec, _prepend(first, gen), workers), stats, files)
    enc_s = time.perf_counter() - t0
    report_stats(stats, counts["repeats"])
    return _meta(plan, rec, tok, version, _split_counts(tmp, counts), stats, counts, spec, enc_s)


def _tokenizer_and_progress(plan: PrepareRequest, files, tmp: Path, rec: dict | None, fingerprint: str):
    """(tokenizer, progress record): trained and recorded when starting (rec None), else read back from tmp."""
    if rec is not None:
        from loom.data.tokenizers import load_tokenizer

        done = rec["splits"]
        log.info(
            f"continuing the unfinished preparation in {tmp}: {done['train']['shards']} train and "
            f"{done['val']['shards']} val shard(s) already complete"
        )
        return load_tokenizer(tmp, {"tokenizer": rec["tokenizer"]}), rec
    total = _count_chars(plan, files, "counting characters") if plan.split_mode == "tail" else None
    tok, kind = _train_tokenizer(plan, files, total)
    info = {"kind": kind, "file": tok.save(tmp), "eot_id": tok.eot_id}
    info["sha256"] = tokenizer_hash(tmp, {"tokenizer": info})  # compares tokenizers by content
    rec = {
        "fingerprint": fingerprint,
        "tokenizer": info,
        "total_chars": total,
        "vocab_size": tok.vocab_size,
        "splits": {s: {"shards": 0, "chunk": 0, "offset": 0} for s in SPLITS},
    }
    _write_json(tmp / PROGRESS, rec)
    return tok, rec


def _drop_uncommitted(tmp: Path, rec: dict) -> None:
    """Anything after the last committed shard of each split is written again: delete it."""
    for s, v in rec["splits"].items():
        for p in tmp.glob(f"{s}_*.bin*"):
            if p.name.endswith(".tmp") or int(p.name[len(s) + 1 : len(s) + 7]) >= v["shards"]:
                p.unlink()


def _chunks(plan: PrepareRequest, units, counts: dict):
    """The (split, text, new document) units in chunks of about plan.chunk_chars characters; counts the
    documents of each split, the val bytes and the repeated documents (among the first REPEAT_CHECK_DOCS)."""
    chunk: list = []
    size = 0
    seen: set[bytes] = set()
    for split, u in units:
        si = SPLITS.index(split)
        if u.new_doc:
            counts["documents"][split] += 1
            if len(seen) < REPEAT_CHECK_DOCS:
                h = hashlib.blake2b(u.text.encode("utf-8", errors="surrogatepass"), digest_size=16).digest()
                counts["repeats"] += h in seen
                seen.add(h)
        if si == 1:
            counts["val_bytes"] += len(u.text.encode("utf-8", errors="surrogatepass"))
        chunk.append((si, u.text, u.new_doc))
        size += len(u.text)
        if size >= plan.chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encoder_of(spec: dict, rec: dict, first, encoder: str, tmp: Path) -> dict:
    """The encoder spec with its backend: the one chosen at the start when continuing (the same ids either
    way), else chosen now on a sample of the first chunk and recorded."""
    if "backend" in rec:
        if rec["backend"] == "tiktoken":
            spec = {**spec, "backend": "tiktoken", "tiktoken": tiktoken_spec(spec["json"])}
        return spec
    probe, n = [], 0
    for _, t, _ in first:  # ~100k characters of the corpus: the check costs a fraction of a second
        probe.append(t[:20_000])
        n += len(probe[-1])
        if n >= 100_000:
            break
    spec = choose_backend(spec, probe, encoder)
    rec["backend"] = spec.get("backend", "tokenizers")
    _write_json(tmp / PROGRESS, rec)
    return spec


def _encode_into(writers: dict, start: dict, results, stats: ReadStats, files) -> None:
    """Each encoded chunk's ids into its split's shards, from where each split stopped (chunk, offset)."""
    tokens = 0
    try:
        with _bar("encoding", estimated_bytes(files)) as update:
            for i, res in enumerate(results):
                if res is not None:
                    for si, s in enumerate(SPLITS):
                        c, off = start[s]
                        if i > c:
                            writers[s].add(res[si], i, 0)
                        elif i == c:
                            writers[s].add(res[si][off:], i, off)
                    tokens += len(res[0]) + len(res[1])
                update(stats.bytes, tokens)
        for w in writers.values():
            if w.n or w.index == 0:
                w.commit(None)
    finally:
        for w in writers.values():
            w.close()


def _split_counts(tmp: Path, counts: dict) -> dict:
    splits = {}
    for s in SPLITS:
        n = [read_header(p)[1] for p in sorted(tmp.glob(f"{s}_*.bin"))]
        splits[s] = {"tokens": int(sum(n)), "documents": counts["documents"][s], "shards": len(n)}
    return splits


def _meta(plan, rec, tok, version, splits, stats: ReadStats, counts, spec, enc_s) -> dict:
    """The core of meta.json."""
    return {
        "format": "llm.c",
        "tokenizer": rec["tokenizer"],
        "vocab_size": tok.vocab_size,
        "shard_version": version,
        "splits": splits,
        "files": stats.files,
        "documents": stats.documents,
        "bytes": stats.bytes,
        "replaced_files": stats.replaced_files,
        "skipped_binary": stats.skipped_binary_count,
        "dropped_documents": stats.dropped_count,
        "bad_lines": stats.bad_lines_count,
        "corrupt_files": len(stats.corrupt),
        "repeated_documents": counts["repeats"],
        "val_fraction": plan.val_fraction,
        "split_mode": plan.split_mode if plan.split_mode == "docs" else "tail",
        "seed": plan.seed,
        "bytes_per_token_val": counts["val_bytes"]
        / max(1, splits["val"]["tokens"] - splits["val"]["documents"]),
        "encoder": spec["kind"]
        if spec["kind"] in ("char", "sentencepiece")
        else spec.get("backend", "tokenizers"),
        "encode_seconds": round(enc_s, 2),
    }


def _prepend(first, rest):
    yield first
    yield from rest


def prepare_corpus(name: str, out: str | Path, tokenizer: str, vocab_size: int, seed: int = 1337) -> dict:
    """Prepare a built-in corpus (see loom.data.corpus)."""
    from loom.data.corpus import corpus_files

    return prepare(
        corpus_files(name),
        out,
        tokenizer,
        vocab_size,
        seed=seed,
        source=f"built-in corpus {name}",
        force=True,
    )
