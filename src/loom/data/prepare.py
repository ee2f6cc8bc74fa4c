"""`loom data prepare`: text files, folders or JSONL -> tokenizer -> train/val token shards + meta.json.

Everything is written into `<out>.tmp` and renamed at the end, so a failure leaves nothing half-made and an
existing directory is never overwritten without --force.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from loom import __version__, log
from loom.data.shards import version_for_vocab, write_shard
from loom.data.tokenizers import CharTokenizer, HFTokenizer, check_bpe_vocab, tokenizer_hash
from loom.errors import LoomError
from loom.outputs import check_apart, check_replaceable, replace_output, write_marker

SHARD_TOKENS = 100_000_000  # llm.c's shard size
BINARY_PROBE = 8192


@dataclass
class Documents:
    """Documents read from the inputs, with what was noticed on the way."""

    texts: list[str] = field(default_factory=list)
    files: int = 0
    replaced_files: int = 0  # files with undecodable bytes (replaced by U+FFFD)
    skipped_binary: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)  # where bytes were replaced: file or file:line
    dropped: list[str] = field(default_factory=list)  # documents left out, as "where (why)"
    read_once: list[str] = field(default_factory=list)  # inputs named again (directly or inside a folder)


def _is_binary(head: bytes) -> bool:
    return b"\x00" in head


def _read_text(path: Path, docs: Documents, explicit: bool) -> str | None:
    data = path.read_bytes()
    if _is_binary(data[:BINARY_PROBE]):
        if explicit:
            raise LoomError(
                f"input '{path}' looks binary (it contains NUL bytes), not text",
                hint="give text files, folders of text files (with --glob), or JSONL",
            )
        docs.skipped_binary.append(str(path))
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        docs.replaced_files += 1
        docs.replaced.append(str(path))
    docs.files += 1
    if not text:
        docs.dropped.append(f"{path} (empty)")
    return text


def _kind_of(value) -> str:
    """How a JSON value that is not a non-empty string reads in a message."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "empty"
    names = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _read_jsonl(path: Path, field_name: str, docs: Documents) -> None:
    docs.files += 1
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8", errors="replace"))
            except json.JSONDecodeError as e:
                raise LoomError(f"{path}:{lineno} is not valid JSON: {e.msg}") from None
            if not isinstance(rec, dict) or field_name not in rec:
                raise LoomError(
                    f"{path}:{lineno} has no field '{field_name}'",
                    hint="name the text field with --jsonl-field",
                )
            text = rec[field_name]
            if isinstance(text, str) and text:
                # JSON may escape lone surrogates (\ud800) that no encoder accepts: replace them.
                clean = text.encode("utf-8", errors="replace").decode("utf-8")
                if clean != text:
                    docs.replaced_files += 1
                    docs.replaced.append(f"{path}:{lineno}")
                docs.texts.append(clean)
            else:
                docs.dropped.append(f"{path}:{lineno} ('{field_name}' is {_kind_of(text)})")


def _read_parquet(path: Path, column: str, docs: Documents) -> None:
    """One document per non-empty string of the text column (pyarrow: the loom[parquet] extra)."""
    from loom.data.formats import read_parquet_texts

    docs.files += 1
    rows: list[int] = []
    docs.texts.extend(read_parquet_texts(path, column, dropped=rows))
    docs.dropped.extend(f"{path} row {r} ('{column}' is not a non-empty string)" for r in rows)


def _input_files(paths: list[Path], glob: str, docs: Documents) -> list[tuple[Path, bool]]:
    """(file, named explicitly) for every input file, each real file once: a file given twice, or given
    beside a folder that holds it, would put the same text in train and val. Repeats go to docs.read_once."""
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
            docs.read_once.append(str(f))
            if explicit:  # named on its own: a binary file is an error, as when named once
                out[seen[key]] = (out[seen[key]][0], True)
            continue
        seen[key] = len(out)
        out.append((f, explicit))
    return out


def read_documents(inputs: list[str | Path], glob: str = "*", jsonl_field: str = "text") -> Documents:
    """One document per text file, JSONL line or Parquet row. Folders are searched recursively with `glob`."""
    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise LoomError(f"input path does not exist: {', '.join(missing)}", hint="check the --input paths")
    docs = Documents()
    for f, explicit in _input_files(paths, glob, docs):
        if f.suffix == ".jsonl":
            _read_jsonl(f, jsonl_field, docs)
        elif f.suffix == ".parquet":
            _read_parquet(f, jsonl_field, docs)
        elif (text := _read_text(f, docs, explicit=explicit)) is not None:
            docs.texts.append(text)
    docs.texts = [t for t in docs.texts if t]
    if not docs.texts:
        where = ", ".join(str(p) for p in paths)
        extra = f" ({len(docs.skipped_binary)} binary files skipped)" if docs.skipped_binary else ""
        raise LoomError(
            f"the corpus is empty: no text found in {where}{extra}", hint="check --input and --glob"
        )
    return docs


def _some(items: list[str], n: int = 3) -> str:
    """The first n items, and how many more."""
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def report_documents(docs: Documents) -> int:
    """Warn about everything read_documents noticed, naming the first few; returns the number of documents
    whose text repeats an earlier one (by content hash)."""
    if docs.read_once:
        log.warn(f"{len(docs.read_once)} input file(s) were named more than once (directly or inside a folder)"
                 f" and are read once: {_some(docs.read_once)}")  # fmt: skip
    if docs.replaced:
        log.warn(f"{len(docs.replaced)} file(s) or line(s) had undecodable bytes, replaced with U+FFFD: "
                 f"{_some(docs.replaced)}")  # fmt: skip
    if docs.skipped_binary:
        log.warn(f"skipped {len(docs.skipped_binary)} binary file(s): {_some(docs.skipped_binary)}")
    if docs.dropped:
        log.warn(f"dropped {len(docs.dropped)} document(s) with no text: {_some(docs.dropped, 5)}")
    seen: set[bytes] = set()
    repeats = 0
    for t in docs.texts:
        h = hashlib.blake2b(t.encode("utf-8", errors="surrogatepass"), digest_size=16).digest()
        repeats += h in seen
        seen.add(h)
    if repeats:
        log.warn(f"{repeats} document(s) repeat the text of an earlier one: with the docs split a copy can land "
                 "in val while its original trains, which makes the val loss too low")  # fmt: skip
    return repeats


def _val_documents(sizes: list[int], val_fraction: float, seed: int) -> set[int]:
    """Indices of the val documents: val's share of the characters close to val_fraction, whatever the sizes.

    Counting documents instead sends 40-70% of the text to val when a few documents are large. In a seeded
    order, every document that still fits under the target joins val (first fit); then the one left whose
    addition lands closest to the target joins too when that is closer (always when val is still empty).
    Train keeps at least one document. Characters stand in for tokens, which are counted after the split
    (prepare warns when the share of tokens ends up far from the target)."""
    order = np.random.default_rng(seed).permutation(len(sizes)).tolist()
    target = val_fraction * sum(sizes)
    chosen: list[int] = []
    total = 0
    for i in order:
        if total + sizes[i] <= target:
            chosen.append(i)
            total += sizes[i]
    rest = [i for i in order if i not in set(chosen)]
    best = min(rest, key=lambda i: abs(total + sizes[i] - target))
    if len(rest) > 1 and (not chosen or abs(total + sizes[best] - target) < target - total):
        chosen.append(best)
    return set(chosen)


def split_documents(
    texts: list[str], val_fraction: float, mode: str, seed: int
) -> tuple[list[str], list[str]]:
    """Train/val split. `docs`: whole documents, chosen in a seeded order until val holds `val_fraction` of
    the characters (see _val_documents); `tail`: the last fraction of the concatenated characters (nanoGPT's
    90/10 split). A single document falls back to `tail`."""
    if not 0.0 < val_fraction < 1.0:
        raise LoomError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if mode == "docs" and len(texts) >= 2:
        val_idx = _val_documents([len(t) for t in texts], val_fraction, seed)
        return [t for i, t in enumerate(texts) if i not in val_idx], [
            t for i, t in enumerate(texts) if i in val_idx
        ]
    if mode not in ("docs", "tail"):
        raise LoomError(f"unknown --split-mode '{mode}'", hint="use docs or tail")
    total = sum(len(t) for t in texts)
    cut = int(total * (1.0 - val_fraction))
    if cut <= 0 or cut >= total:
        raise LoomError(f"the corpus ({total} characters) is too small to split into train and val")
    train, val, seen = [], [], 0
    for t in texts:
        if seen + len(t) <= cut:
            train.append(t)
        elif seen >= cut:
            val.append(t)
        else:
            train.append(t[: cut - seen])
            val.append(t[cut - seen :])
        seen += len(t)
    return train, val


def _char_chunk(args) -> np.ndarray:
    """Encode a list of texts with a char table (runs in a worker process)."""
    texts, lut, eot = args
    out = []
    for t in texts:
        cps = np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32)
        out.append(np.concatenate([[eot], lut[cps]]))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _chunks(texts: list[str], chars_per_chunk: int = 1 << 20):
    chunk, size = [], 0
    for t in texts:
        chunk.append(t)
        size += len(t)
        if size >= chars_per_chunk:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_documents(tok, texts: list[str], label: str) -> np.ndarray:
    """Token ids of all documents, each preceded by end-of-text (llm.c's convention), with a progress bar.
    Uses every core: worker processes for char, the tokenizers library's threads for BPE."""
    from rich.progress import Progress

    chunks = list(_chunks(texts))
    parts: list[np.ndarray] = []
    with Progress(transient=True, console=log.console()) as bar:
        task = bar.add_task(f"tokenizing {label}", total=len(chunks))
        if isinstance(tok, CharTokenizer):
            lut = np.full(0x110000, -1, dtype=np.int64)
            lut[[ord(c) for c in tok.chars]] = np.arange(len(tok.chars))
            jobs = [(c, lut, tok.eot_id) for c in chunks]
            procs = min(len(jobs), os.cpu_count() or 1)
            if procs > 1:
                with get_context("fork").Pool(procs) as pool:
                    for arr in pool.imap(_char_chunk, jobs):
                        parts.append(arr)
                        bar.advance(task)
            else:
                for job in jobs:
                    parts.append(_char_chunk(job))
                    bar.advance(task)
        else:
            for c in chunks:
                for ids in tok.encode_batch(c):
                    parts.append(np.asarray([tok.eot_id, *ids], dtype=np.int64))
                bar.advance(task)
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if tokens.size and tokens.min() < 0:
        raise LoomError("a character is missing from the character vocabulary")
    return tokens


def build_tokenizer(spec: str, train_texts: list[str], all_texts: list[str], vocab_size: int):
    """`char`, `bpe` (trained here on the train split) or the path of an existing tokenizer.json."""
    if spec == "char":
        return CharTokenizer.train(all_texts), "char"
    if spec == "bpe":
        return HFTokenizer.train(train_texts, vocab_size), "bpe"
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise LoomError(f"--tokenizer '{spec}' is neither char, bpe nor an existing tokenizer.json")
    return HFTokenizer.from_file(path), "tokenizer.json"


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
) -> dict:
    """Prepare a data directory; returns its meta.json contents."""
    out = Path(out)
    check_apart(out, inputs)
    check_replaceable(out, "data", force)  # before any reading; replaced only once the new one is ready
    if tokenizer == "bpe":
        check_bpe_vocab(vocab_size)  # before any reading
    t0 = time.perf_counter()
    docs = read_documents(inputs, glob, jsonl_field)
    repeats = report_documents(docs)
    if split_mode == "docs" and len(docs.texts) < 2:
        log.info("one document only: splitting its characters (train first, val last)")
    train, val = split_documents(docs.texts, val_fraction, split_mode, seed)
    tok, kind = build_tokenizer(tokenizer, train, docs.texts, vocab_size)

    tmp = out.with_name(f".{out.name}.loom-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = _write_prepared(tmp, tok, kind, train, val, shard_tokens)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failure leaves nothing half-made
        raise
    meta.update(
        source=source or ", ".join(str(p) for p in inputs),
        files=docs.files,
        replaced_files=docs.replaced_files,
        skipped_binary=len(docs.skipped_binary),
        dropped_documents=len(docs.dropped),
        repeated_documents=repeats,
        val_fraction=val_fraction,
        split_mode=split_mode,
        seed=seed,
        loom_version=__version__,
    )
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    write_marker(tmp, "data")
    replace_output(out, "data", force)
    os.replace(tmp, out)
    splits = meta["splits"]
    share = splits["val"]["tokens"] / max(1, splits["train"]["tokens"] + splits["val"]["tokens"])
    log.info(
        f"prepared {out}: {kind} tokenizer, vocab {tok.vocab_size}, train {splits['train']['tokens']:,} tokens"
        f" ({splits['train']['documents']} docs), val {splits['val']['tokens']:,} tokens"
        f" ({share:.1%}, {splits['val']['documents']} docs) in {time.perf_counter() - t0:.1f}s"
    )
    if abs(share - val_fraction) > max(0.02, 0.25 * val_fraction):
        log.warn(f"val holds {share:.1%} of the tokens, not the {val_fraction:.1%} asked by --val-fraction: the "
                 f"{len(docs.texts)} documents are too few or too uneven to split closer by whole documents "
                 "(--split-mode tail cuts at the exact share)")  # fmt: skip
    return meta


def _write_prepared(tmp: Path, tok, kind: str, train: list[str], val: list[str], shard_tokens: int) -> dict:
    """Tokenize both splits into shards under tmp, save the tokenizer; the core of meta.json."""
    version = version_for_vocab(tok.vocab_size)
    splits = {}
    for name, texts in (("train", train), ("val", val)):
        tokens = encode_documents(tok, texts, name)
        n_shards = max(1, -(-tokens.size // shard_tokens))
        for i in range(n_shards):
            write_shard(
                tmp / f"{name}_{i:06d}.bin", tokens[i * shard_tokens : (i + 1) * shard_tokens], version
            )
        splits[name] = {"tokens": int(tokens.size), "documents": len(texts), "shards": n_shards}
    info = {"kind": kind, "file": tok.save(tmp), "eot_id": tok.eot_id}
    info["sha256"] = tokenizer_hash(tmp, {"tokenizer": info})  # compares tokenizers by content
    return {
        "format": "llm.c",
        "tokenizer": info,
        "vocab_size": tok.vocab_size,
        "shard_version": version,
        "splits": splits,
    }


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
