"""`loom data prepare`: text files, folders or JSONL -> tokenizer -> train/val token shards + meta.json.

Everything is written into `<out>.tmp` and renamed at the end, so a failure leaves nothing half-made and an
existing directory is never overwritten without --force.
"""

from __future__ import annotations

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
from loom.data.tokenizers import CharTokenizer, HFTokenizer, check_bpe_vocab
from loom.errors import LoomError

SHARD_TOKENS = 100_000_000  # llm.c's shard size
BINARY_PROBE = 8192


@dataclass
class Documents:
    """Documents read from the inputs, with what was noticed on the way."""

    texts: list[str] = field(default_factory=list)
    files: int = 0
    replaced_files: int = 0  # files with undecodable bytes (replaced by U+FFFD)
    skipped_binary: list[str] = field(default_factory=list)


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
    docs.files += 1
    return text


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
                docs.texts.append(clean)


def _read_parquet(path: Path, column: str, docs: Documents) -> None:
    """One document per non-empty string of the text column (pyarrow: the loom[parquet] extra)."""
    from loom.data.formats import read_parquet_texts

    docs.files += 1
    docs.texts.extend(read_parquet_texts(path, column))


def read_documents(inputs: list[str | Path], glob: str = "*", jsonl_field: str = "text") -> Documents:
    """One document per text file, JSONL line or Parquet row. Folders are searched recursively with `glob`."""
    paths = [Path(p) for p in inputs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise LoomError(f"input path does not exist: {', '.join(missing)}", hint="check the --input paths")
    docs = Documents()
    for p in paths:
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob(glob)
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
            )
            for f in found:
                if f.suffix == ".jsonl":
                    _read_jsonl(f, jsonl_field, docs)
                elif f.suffix == ".parquet":
                    _read_parquet(f, jsonl_field, docs)
                elif (text := _read_text(f, docs, explicit=False)) is not None:
                    docs.texts.append(text)
        elif p.suffix == ".jsonl":
            _read_jsonl(p, jsonl_field, docs)
        elif p.suffix == ".parquet":
            _read_parquet(p, jsonl_field, docs)
        else:
            docs.texts.append(_read_text(p, docs, explicit=True))
    docs.texts = [t for t in docs.texts if t]
    if not docs.texts:
        where = ", ".join(str(p) for p in paths)
        extra = f" ({len(docs.skipped_binary)} binary files skipped)" if docs.skipped_binary else ""
        raise LoomError(
            f"the corpus is empty: no text found in {where}{extra}", hint="check --input and --glob"
        )
    return docs


def split_documents(
    texts: list[str], val_fraction: float, mode: str, seed: int
) -> tuple[list[str], list[str]]:
    """Train/val split. `docs`: whole documents, chosen by a seeded shuffle; `tail`: the last fraction of the
    concatenated characters (nanoGPT's 90/10 split). A single document falls back to `tail`."""
    if not 0.0 < val_fraction < 1.0:
        raise LoomError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if mode == "docs" and len(texts) >= 2:
        n_val = min(len(texts) - 1, max(1, round(val_fraction * len(texts))))
        val_idx = set(np.random.default_rng(seed).permutation(len(texts))[:n_val].tolist())
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
    if out.exists() and not out.is_dir():
        raise LoomError(f"--out '{out}' is a file, not a directory", hint="choose a directory path for --out")
    if out.exists() and any(out.iterdir()) and not force:
        raise LoomError(
            f"output directory '{out}' already exists and is not empty",
            hint="choose another --out, or pass --force to replace it",
        )
    if tokenizer == "bpe":
        check_bpe_vocab(vocab_size)  # before any reading
    t0 = time.perf_counter()
    docs = read_documents(inputs, glob, jsonl_field)
    if docs.replaced_files:
        log.warn(f"{docs.replaced_files} file(s) had undecodable bytes; they were replaced with U+FFFD")
    if docs.skipped_binary:
        log.warn(f"skipped {len(docs.skipped_binary)} binary file(s), e.g. {docs.skipped_binary[0]}")
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
        val_fraction=val_fraction,
        split_mode=split_mode,
        seed=seed,
        loom_version=__version__,
    )
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    splits = meta["splits"]
    log.info(
        f"prepared {out}: {kind} tokenizer, vocab {tok.vocab_size}, train {splits['train']['tokens']:,} tokens"
        f" ({splits['train']['documents']} docs), val {splits['val']['tokens']:,} tokens"
        f" ({splits['val']['documents']} docs) in {time.perf_counter() - t0:.1f}s"
    )
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
    return {
        "format": "llm.c",
        "tokenizer": {"kind": kind, "file": tok.save(tmp), "eot_id": tok.eot_id},
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
