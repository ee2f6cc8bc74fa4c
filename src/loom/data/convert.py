"""`loom data convert` and `loom data inspect`: token data between formats, and what a file or folder holds.

A directory is converted split by split (train, val), every token kept in order; the tokenizer travels
with it (loom's tokenizer file, or a nanogpt character table) in a loom `meta.json`, plus a nanogpt
`meta.pkl` when the target is nanogpt and the vocabulary is a character table. Everything is written into
a temporary folder that is renamed at the end, so a failure leaves nothing half-made.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np

from loom import __version__, log
from loom.data import megatron
from loom.data.formats import (
    FORMATS,
    SPLITS,
    TOKEN_FORMATS,
    Format,
    Tokens,
    check_ids_fit,
    detect_dir,
    detect_file,
    doc_offsets_from_eot,
    id_range,
    read_meta,
    read_parquet_texts,
    split_files,
)
from loom.data.shards import write_ids
from loom.data.tokenizers import CharTokenizer, load_tokenizer
from loom.errors import LoomError
from loom.outputs import check_apart, check_replaceable, replace_output, write_marker
from loom.paths import check_not_endless, check_output_dir, check_output_file

SHARD_TOKENS = 100_000_000  # llm.c's shard size: bigger inputs are cut into shards this long (llmc, npy)


def known_meta(d: Path) -> dict | None:
    """The meta of a directory only when it has one (meta.json / meta.pkl): no scan of the ids."""
    return read_meta(d) if (d / "meta.json").is_file() or (d / "meta.pkl").is_file() else None


def _eot(meta: dict | None, eot_id: int | None) -> int | None:
    return eot_id if eot_id is not None else ((meta or {}).get("tokenizer") or {}).get("eot_id")


def _check_eot(eot_id: int | None, vocab: int, vocab_from: str, src: Path) -> None:
    """An --eot-id the data's vocabulary does not hold starts no document: refused, instead of an index that
    holds one document per file."""
    if eot_id is not None and eot_id >= vocab:
        raise LoomError(
            f"--eot-id {eot_id} is outside the vocabulary of '{src}' (ids 0..{vocab - 1}, from {vocab_from}): "
            "no document would start with it",
            hint="give the end-of-text id of the tokenizer the data was made with (gpt2's is 50256), or leave "
            "--eot-id out to use the one its meta.json names",
        )


def _with_documents(t: Tokens, target: Format, eot: int | None, where: Path) -> Tokens:
    """Recover document boundaries from end-of-text ids when the target keeps documents and the source
    did not."""
    if target.keeps_documents and t.doc_offsets is None and eot is not None:
        off = doc_offsets_from_eot(t.ids, eot)
        if len(off) == 2 and len(t.ids) > 1 and int(t.ids[0]) != eot:
            log.warn(
                f"end-of-text id {eot} does not occur in '{where}': its {len(t.ids):,} tokens are one document"
            )
        return Tokens(t.ids, off)
    return t


def _pieces(t: Tokens, n: int) -> list[Tokens]:
    return [Tokens(t.ids[i : i + n]) for i in range(0, len(t.ids), n)] or [t]


def _write_split(target: Format, out: Path, split: str, parts: list[Tokens], dtype) -> int:
    """Write one split's parts into `out` in the target's naming; returns the number of files."""
    if target.name == "nanogpt":  # one file per split: the parts appended
        path = out / target.out_name(split, 0)
        with open(path, "wb") as f:
            for t in parts:
                check_ids_fit(t.ids, dtype, f"nanogpt file '{path}'")
                write_ids(f, t.ids, dtype)
        return 1
    if not target.keeps_documents:
        parts = [p for t in parts for p in _pieces(t, SHARD_TOKENS)]
    for i, t in enumerate(parts):
        target.write(out / target.out_name(split, i), t, dtype)
    return len(parts)


def _nanogpt_table(src: Path, meta: dict) -> tuple[dict, dict, int] | None:
    """(itos, stoi, vocab_size) for a nanogpt meta.pkl when the source's tokenizer is a character table."""
    info = meta.get("tokenizer") or {}
    if info.get("kind") != "char":
        return None
    if "chars" in info:  # came from nanogpt: its table as it was
        chars = list(info["chars"])
        itos = dict(enumerate(chars))
        return itos, {c: i for i, c in itos.items()}, int(meta.get("nanogpt_vocab_size", len(chars)))
    tok = load_tokenizer(src, meta)  # loom's char tokenizer: its end-of-text id is in the data
    assert isinstance(tok, CharTokenizer)
    itos = dict(enumerate(tok.chars))
    return itos | {tok.eot_id: "<|endoftext|>"}, {c: i for i, c in itos.items()}, tok.vocab_size


def _write_meta(
    src: Path, tmp: Path, meta: dict, source_fmt: str, target: Format, splits: dict, eot: int | None
) -> None:
    info = meta.get("tokenizer") or None
    if eot is not None:  # what data.align=bos and data.doc_mask read (a tokenizer entry of just the id)
        info = {**(info or {}), "eot_id": eot}
    if info and info.get("file"):
        shutil.copy2(src / info["file"], tmp / info["file"])
    out = {
        "format": "llm.c" if target.name == "llmc" else target.name,
        "tokenizer": info,
        "vocab_size": int(meta["vocab_size"]),
        **({"nanogpt_vocab_size": meta["nanogpt_vocab_size"]} if "nanogpt_vocab_size" in meta else {}),
        "splits": splits,
        "source": f"{src} ({source_fmt})",
        "converted_by": f"loom {__version__}",
    }
    (tmp / "meta.json").write_text(json.dumps(out, indent=1), encoding="utf-8")
    table = _nanogpt_table(src, meta) if target.name == "nanogpt" else None
    if table:  # what nanogpt's train.py / sample.py read (plain dicts of ints and strs)
        itos, stoi, vocab = table
        with open(tmp / "meta.pkl", "wb") as f:
            pickle.dump({"vocab_size": vocab, "itos": itos, "stoi": stoi}, f)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and (out.is_file() or any(out.iterdir())) and not force:
        raise LoomError(
            f"output '{out}' already exists", hint="choose another output, or pass --force to replace it"
        )
    if out.is_dir():
        check_replaceable(out, "data", force, "output")  # --force replaces only a data set loom wrote


def _convert_dir(src: Path, out: Path, source: Format, target: Format, dtype, eot_id: int | None) -> dict:
    meta = read_meta(src)
    _check_eot(eot_id, int(meta["vocab_size"]), meta.get("vocab_from", "meta.json"), src)
    eot = _eot(meta, eot_id)
    dt = np.dtype(dtype) if dtype else np.dtype(target.default_dtype(int(meta["vocab_size"]) - 1))
    tmp = out.with_name(f".{out.name}.loom-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        splits = {}
        for split in SPLITS:
            files = source.split_files(src, split)
            if not files:
                continue
            parts = [_with_documents(source.read(f), target, eot, f) for f in files]
            n_files = _write_split(target, tmp, split, parts, dt)
            docs = [len(t.doc_offsets) - 1 for t in parts if t.doc_offsets is not None]
            splits[split] = {
                "tokens": int(sum(len(t.ids) for t in parts)),
                "documents": int(sum(docs)) if len(docs) == len(parts) else None,
                "shards": n_files,
            }
        if not splits:
            split_files(src, "train", source.name)  # raises: no shards of either split
        _write_meta(src, tmp, meta, source.name, target, splits, eot)
        write_marker(tmp, "data")
        if out.is_dir():
            replace_output(out, "data", True, "output")
        elif out.exists():
            out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "input": str(src),
        "output": str(out),
        "from": source.name,
        "to": target.name,
        "dtype": dt.name,
        "splits": splits,
    }


def _convert_file(src: Path, out: Path, source: Format, target: Format, dtype, eot_id: int | None) -> dict:
    meta = known_meta(src.parent)
    t = source.read(src)
    r = id_range([t.ids])
    if meta is not None:
        _check_eot(eot_id, int(meta["vocab_size"]), meta.get("vocab_from", "meta.json"), src)
    elif r is not None:  # no meta: the vocabulary the data shows
        _check_eot(eot_id, r[1] + 1, "max id + 1", src)
    t = _with_documents(t, target, _eot(meta, eot_id), src)
    dt = np.dtype(dtype) if dtype else np.dtype(target.default_dtype(r[1] if r else 0))
    written = target.write(out, t, dt)
    docs = None if t.doc_offsets is None else len(t.doc_offsets) - 1
    return {
        "input": str(src),
        "output": [str(p) for p in written],
        "from": source.name,
        "to": target.name,
        "dtype": dt.name,
        "tokens": len(t.ids),
        "documents": docs,
    }


def _check_dtype(dtype: str | None) -> str | None:
    """--dtype names an integer NumPy dtype (the writer then checks what its format allows)."""
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.kind not in "iu":
        raise LoomError(
            f"--dtype '{dtype}' is not an integer token dtype",
            hint="use uint16 or uint32 (int32, int64 where the format allows them)",
        )
    return dtype


def convert(
    src: str | Path,
    out: str | Path,
    to: str,
    source_format: str | None = None,
    dtype: str | None = None,
    eot_id: int | None = None,
    force: bool = False,
) -> dict:
    """Convert a data directory (train/val splits) or one file from one token format to another."""
    src, out = Path(src), Path(out)
    if not src.exists() and not (src.with_name(src.name + ".idx")).is_file():
        raise LoomError(f"input '{src}' does not exist")
    check_not_endless(src, "input")
    if to not in TOKEN_FORMATS:
        raise LoomError(f"cannot write '{to}'", hint=f"--to is one of {', '.join(TOKEN_FORMATS)}")
    dtype = _check_dtype(dtype)
    if eot_id is not None and eot_id < 0:
        raise LoomError(f"--eot-id must be a token id (>= 0), got {eot_id}")
    fmt = source_format or (detect_dir(src) if src.is_dir() else detect_file(src))
    if fmt is None:
        split_files(src, "train")  # raises with the reason
    if fmt == "parquet":
        FORMATS["parquet"].open(src)  # raises: Parquet is text, for `loom data prepare`
    source, target = FORMATS[fmt], FORMATS[to]
    check_apart(out, [src], "output", inside_ok=True)
    if src.is_dir():
        check_output_dir(out, "output", temp_beside=True)  # written beside it first, then renamed
        _check_out(out, force)
        summary = _convert_dir(src, out, source, target, dtype, eot_id)
    else:
        outs = [megatron.bin_path(out), megatron.idx_path(out)] if to == "megatron" else [out]
        if any(q.exists() for q in outs) and not force:
            raise LoomError(f"output '{out}' already exists", hint="choose another output, or pass --force")
        for q in outs:
            check_output_file(q, "output")
        summary = _convert_file(src, out, source, target, dtype, eot_id)
    return summary


# ------------------------------------------------------------------------------------------- inspect


def _split_stats(source: Format, files: list[Path], eot: int | None, meta_split: dict | None) -> dict:
    parts = [source.read(f) for f in files]
    r = id_range([t.ids for t in parts])
    if all(t.doc_offsets is not None for t in parts):
        docs, how = sum(len(t.doc_offsets) - 1 for t in parts), "index"
    elif meta_split and meta_split.get("documents") is not None:
        docs, how = meta_split["documents"], "meta.json"
    elif eot is not None:
        docs = sum(
            int(np.count_nonzero(t.ids[i : i + SHARD_TOKENS] == eot))
            for t in parts
            for i in range(0, len(t.ids), SHARD_TOKENS)
        )
        how = f"end-of-text id {eot}"
    else:
        docs, how = None, None
    return {
        "files": [f.name for f in files],
        "dtype": sorted({t.ids.dtype.name for t in parts}),
        "tokens": int(sum(len(t.ids) for t in parts)),
        "documents": None if docs is None else int(docs),
        "documents_from": how,
        "min_id": None if r is None else r[0],
        "max_id": None if r is None else r[1],
    }


def _sample(d: Path, meta: dict | None, arrays: list[np.ndarray], n: int) -> str | None:
    if not meta or not meta.get("tokenizer") or n <= 0:
        return None
    try:
        tok = load_tokenizer(d, meta)
    except LoomError as e:
        log.warn(f"no decoded sample: {e.message}")
        return None
    first = next((a for a in arrays if len(a)), None)
    return None if first is None else tok.decode(np.asarray(first[:n]).tolist())


def inspect(path: str | Path, fmt: str | None = None, sample_tokens: int = 64, column: str = "text") -> dict:
    """What a data directory or file holds: format, dtype, token and document counts, id range, vocab and,
    when a tokenizer is known (loom meta.json, nanogpt meta.pkl), the first tokens decoded."""
    p = Path(path)
    check_not_endless(p, "path")
    if p.is_dir():
        fmt = fmt or detect_dir(p)
        groups = {s: split_files(p, s, fmt) for s in SPLITS if fmt and FORMATS[fmt].split_files(p, s)}
        if not groups:
            split_files(p, "train", fmt)  # raises with the reason
        meta = read_meta(p)
        source, where = FORMATS[fmt], p
    else:
        fmt = fmt or detect_file(p, "--format")
        if fmt == "parquet":
            texts = read_parquet_texts(p, column)
            return {
                "path": str(p),
                "format": "parquet",
                "documents": len(texts),
                "characters": sum(map(len, texts)),
                "sample": texts[0][:200] if texts else None,
            }
        source, where = FORMATS[fmt], p.parent
        meta = known_meta(where)
        groups = {p.name: [p]}
    eot = _eot(meta, None)
    splits = {
        s: _split_stats(source, fs, eot, ((meta or {}).get("splits") or {}).get(s))
        for s, fs in groups.items()
    }
    vocab = (meta or {}).get("vocab_size")
    for s, v in splits.items():
        if vocab and v["max_id"] is not None and v["max_id"] >= vocab:
            src = meta.get("vocab_from", "meta.json")
            log.warn(f"{s}: token id {v['max_id']} is not below the vocabulary size {vocab} of {src}")
    first = next(s for s in ("val", "train", *groups) if s in groups)  # the sample: val when there is one
    arrays = [source.open(f) for f in groups[first]]
    tokenizer = (meta or {}).get("tokenizer") or {}
    return {
        "path": str(p),
        "format": fmt,
        "vocab_size": None if meta is None else meta.get("vocab_size"),
        "vocab_from": None if meta is None else meta.get("vocab_from", "meta.json"),
        "tokenizer": tokenizer.get("kind"),
        "splits": splits,
        "sample_from": first,
        "sample_ids": np.asarray(arrays[0][:16]).tolist() if arrays else [],
        "sample": _sample(where, meta, arrays, sample_tokens),
    }


def write_foreign_meta(d: Path, info: dict) -> dict:
    """meta.json for a foreign token directory (llm.c/FineWeb shards): the vocabulary as max id + 1 over
    every token (inspect scanned them all), token and document counts per split; no tokenizer."""
    top = max(s["max_id"] for s in info["splits"].values() if s["max_id"] is not None)
    meta = {
        "format": info["format"],
        "vocab_size": int(top) + 1,
        "tokenizer": None,
        "vocab_from": "max id + 1 (loom data inspect --write-meta)",
        "splits": {
            k: {"tokens": v["tokens"], "documents": v["documents"], "shards": len(v["files"])}
            for k, v in info["splits"].items()
        },
    }
    tmp = d / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1), encoding="utf-8")
    os.replace(tmp, d / "meta.json")
    log.info(
        f"wrote {d / 'meta.json'}: vocab {meta['vocab_size']:,} (max id + 1); training reads it at start"
    )
    return meta


def _row_range(text: str) -> tuple[int, int]:
    try:
        first, _, last = text.partition("-")
        a, b = int(first), int(last or first)
    except ValueError:
        raise LoomError(f"--rows takes A-B (or A), got '{text}'") from None
    if a < 0 or b < a:
        raise LoomError(f"--rows {text}: need 0 <= A <= B")
    return a, b


def _inspect_rows(args) -> int:
    """`loom data inspect PATH --rows A-B --block-size T --seed S`: the training rows A..B of a run on PATH
    (windows of T + 1 tokens in the run's order: loom.data.loader.ShardLoader.global_rows), decoded when the
    data has a tokenizer."""
    from loom.data.loader import ShardLoader
    from loom.data.sft import ChatLoader, is_chat_data
    from loom.data.tokenizers import has_tokenizer

    first, last = _row_range(args.rows)
    if args.block_size < 1 or args.seed is None:
        raise LoomError(
            "--rows needs the run's --block-size and --seed", hint="copy the command from the step's record"
        )
    meta = read_meta(args.path)
    if is_chat_data(meta):  # SFT's rows: packed conversations in the run's epoch order (loom.data.sft)
        chat = ChatLoader(args.path, 1, args.block_size, args.seed, pack=not args.no_pack)
        rows = chat.global_rows(first, last - first + 1)[0].tolist()
    else:
        loader = ShardLoader(args.path, 1, args.block_size, args.seed, align=args.align)
        rows = loader.global_rows(first, last - first + 1).tolist()
    tok = load_tokenizer(args.path, meta) if has_tokenizer(meta) else None
    out = [
        {"row": first + i, "tokens": r, "text": tok.decode(r) if tok else None} for i, r in enumerate(rows)
    ]
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    for rec in out:
        shown = repr(rec["text"]) if rec["text"] is not None else " ".join(map(str, rec["tokens"]))
        print(f"row {rec['row']}: {shown}")
    return 0


def _print_inspect(info: dict) -> None:
    from rich.table import Table

    con = log.console()
    if info["format"] == "parquet":
        con.print(
            f"{info['path']}: parquet, {info['documents']:,} documents, {info['characters']:,} characters"
        )
        con.print(f"sample: {info['sample']!r}", markup=False)
        return
    vocab = "unknown" if info["vocab_size"] is None else f"{info['vocab_size']:,} (from {info['vocab_from']})"
    con.print(
        f"{info['path']}: {info['format']}, vocab {vocab}, tokenizer {info['tokenizer'] or 'none'}",
        markup=False,
    )
    table = Table(box=None)
    for col in ("split", "files", "dtype", "tokens", "documents", "ids"):
        table.add_column(col, justify="right" if col in ("files", "tokens", "documents") else "left")
    for name, s in info["splits"].items():
        docs = "n/a" if s["documents"] is None else f"{s['documents']:,} ({s['documents_from']})"
        ids = "-" if s["min_id"] is None else f"{s['min_id']}..{s['max_id']}"
        table.add_row(name, str(len(s["files"])), ",".join(s["dtype"]), f"{s['tokens']:,}", docs, ids)
    log.print_table(table, con)
    con.print(f"first ids of {info['sample_from']}: {info['sample_ids']}", markup=False)
    if info["sample"] is not None:
        con.print(f"decoded: {info['sample']!r}", markup=False)


# ------------------------------------------------------------------------------------------- CLI


def data_convert_main(argv: list[str]) -> int:
    """`loom data convert [--from FMT] --to FMT IN OUT`."""
    p = argparse.ArgumentParser(
        prog="loom data convert",
        description="Convert token data between formats: a directory (train/val splits) or one file.",
        epilog="formats: llmc (llm.c/modded-nanogpt/loom shards), nanogpt (train.bin/val.bin + meta.pkl), "
        "npy (build-nanogpt shards), megatron (PREFIX.bin + PREFIX.idx)",
    )
    p.add_argument("--from", dest="source", choices=TOKEN_FORMATS, help="input format (default: detected)")
    p.add_argument("--to", dest="target", choices=TOKEN_FORMATS, required=True, help="output format")
    p.add_argument("input", help="a data directory, a file, or a Megatron PREFIX")
    p.add_argument("output", help="a directory (for a directory input), else a file or Megatron PREFIX")
    p.add_argument(
        "--dtype",
        default=None,
        help="token dtype of the output (default: the smallest the target allows for the vocab)",
    )
    p.add_argument(
        "--eot-id",
        type=int,
        default=None,
        help="end-of-text id that starts each document, to write Megatron document boundaries "
        "from a format without them (default: the tokenizer's)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing output")
    args = p.parse_args(argv)
    s = convert(args.input, args.output, args.target, args.source, args.dtype, args.eot_id, args.force)

    def docs(n: int | None) -> str:  # what a Megatron index holds (or the source knew) is said, not assumed
        return "" if n is None else f" ({n:,} document{'s' if n != 1 else ''})"

    if "splits" in s:
        what = ", ".join(
            f"{k} {v['tokens']:,} tokens in {v['shards']} file(s){docs(v['documents'])}"
            for k, v in s["splits"].items()
        )
    else:
        what = f"{s['tokens']:,} tokens{docs(s['documents'])}"
    log.info(f"converted {s['input']} ({s['from']}) -> {s['output']} ({s['to']}, {s['dtype']}): {what}")
    return 0


def _inspect_mix(args) -> int:
    """`loom data inspect --mix ...`: tokens per source, and epochs of each in a run of --tokens tokens."""
    from loom.data.mix import mix_report

    rows = mix_report(args.mix, args.sources, args.tokens)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=1) + "\n")
        return 0
    for r in rows:
        line = f"{r['name']:<12} weight {r['weight']:.3f}  train {r['train_tokens']:>14,}  val {r['val_tokens']:>12,}"
        if args.tokens:
            line += f"  | in {args.tokens:,} tokens: {r['run_tokens']:>14,} = {r['epochs']:.2f} epochs"
        sys.stdout.write(f"{line}  ({r['path']})\n")
    return 0


def data_inspect_main(argv: list[str]) -> int:
    """`loom data inspect PATH [--json]`."""
    p = argparse.ArgumentParser(
        prog="loom data inspect", description="What a token data directory or file holds (format detected)."
    )
    p.add_argument(
        "path", nargs="?", help="a data directory, a token file, a Megatron PREFIX or a .parquet file"
    )
    p.add_argument("--mix", default="", help="a mixture instead of a path: data.mix's SOURCE:WEIGHT,...")
    p.add_argument("--sources", default="", help="with --mix: data.sources' NAME=PATH,...")
    p.add_argument(
        "--tokens", type=int, default=0, help="with --mix: a run's training tokens (epochs of each)"
    )
    p.add_argument("--format", choices=[*TOKEN_FORMATS, "parquet"], default=None, help="skip detection")
    p.add_argument("--sample-tokens", type=int, default=64, help="tokens to decode when a tokenizer is known")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--jsonl-field", default="text", help="a .parquet file's text column (as for prepare)")
    p.add_argument(
        "--rows",
        default="",
        help="print training rows A-B (a bad step's record names them) of the run's window sequence: with "
        "--block-size and --seed (and --align bos) as the run had them",
    )
    p.add_argument("--block-size", type=int, default=0, help="with --rows: the run's model.block_size")
    p.add_argument("--seed", type=int, default=None, help="with --rows: the run's seed (its record says it)")
    p.add_argument(
        "--align", choices=["none", "bos"], default="none", help="with --rows: the run's data.align"
    )
    p.add_argument(
        "--no-pack",
        action="store_true",
        help="with --rows on chat data: one conversation a row (the run's data.doc_mask=false)",
    )
    p.add_argument(
        "--write-meta",
        action="store_true",
        help="write meta.json into a directory that has none (one scan of the ids), so that "
        "training starts without scanning",
    )
    args = p.parse_args(argv)
    if args.mix:
        return _inspect_mix(args)
    if not args.path:
        p.error("give a PATH (or --mix)")
    if args.rows:
        return _inspect_rows(args)
    if args.sample_tokens < 0:
        raise LoomError(f"--sample-tokens must be >= 0 (0: no decoded sample), got {args.sample_tokens}")
    if args.write_meta:
        d = Path(args.path)
        if not d.is_dir():
            raise LoomError(f"--write-meta needs a data directory, not '{d}'")
        if (d / "meta.json").is_file() or (d / "meta.pkl").is_file():
            raise LoomError(
                f"'{d}' already has a meta file", hint="--write-meta is for directories without one"
            )
    info = inspect(args.path, args.format, args.sample_tokens, args.jsonl_field)
    if args.write_meta:
        write_foreign_meta(Path(args.path), info)
    if args.json:
        sys.stdout.write(json.dumps(info, indent=1) + "\n")
    else:
        _print_inspect(info)
    return 0
