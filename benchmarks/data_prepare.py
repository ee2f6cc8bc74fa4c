"""Acceptance measurements of the streaming `loom data prepare` (issue 19).

    python benchmarks/data_prepare.py [--mb 500] [--work /tmp/loom-data-prepare] [--out RESULTS.json]

A corpus of this machine's own C headers and Python sources (/usr/include, /usr/lib/python3*,
/usr/local/lib/python3*, the virtual environment's site-packages; one JSONL record per file) of --mb MB,
and the same twice over (2x), then, each command under `/usr/bin/time -v` (peak RSS of the largest process;
worker processes are separate processes):
  1. `loom data prepare --tokenizer bpe --vocab-size 32768` on 1x and on 2x;
  2. the 1x corpus as .jsonl.gz, .jsonl.zst, Parquet, and a single ~1 GB text file, encoded with the
     tokenizer of step 1 (streaming memory without the tokenizer sample);
  3. encoding speed on the same text: tiktoken (what prepare uses) vs the tokenizers library's encode_batch
     (all cores), with identical ids checked;
  4. BPE training on a 200 MB sample: loom (rustbpe, converted to a tokenizer.json) vs rustbpe alone, and
     the tokenizers library's trainer on a smaller sample for context;
  5. tokens per byte on the val split of a BPE trained on a 100 MB sample vs one trained on all of 1x.
Generated files are deleted at the end. The machine is shared: figures are from one run, ratios back to back.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOM = [sys.executable, "-m", "loom"]
SOURCES = [
    "/usr/include",
    "/usr/lib/python3",
    "/usr/lib/python3.11",
    "/usr/local/lib/python3.11",
    str(ROOT / ".venv/lib"),
    "/usr/local/include",
    "/root/.pyenv",
    "/usr/src",
    "/usr/share",
    "/opt",
    "/usr/lib",
    "/usr/local",
]
SUFFIXES = (".h", ".hpp", ".py")


def source_files():
    seen = set()
    for root in SOURCES:
        if not Path(root).is_dir():
            continue
        for p in sorted(Path(root).rglob("*")):
            if p.suffix in SUFFIXES and p.is_file() and not p.is_symlink():
                key = p.resolve()
                if key not in seen:
                    seen.add(key)
                    yield p


def build_jsonl(path: Path, limit: int) -> int:
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in source_files():
            text = p.read_bytes().decode("utf-8", errors="replace")
            f.write(json.dumps({"text": text}) + "\n")
            size += len(text.encode("utf-8"))
            if size >= limit:
                break
    return size


def timed(cmd: list[str]) -> dict:
    """Wall time and peak RSS (of the largest process) from /usr/bin/time -v."""
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) * 1024
    wall = re.search(r"Elapsed \(wall clock\) time.*: (.+)", r.stderr).group(1).strip()
    parts = [float(x) for x in wall.split(":")]
    secs = sum(v * 60**i for i, v in enumerate(reversed(parts)))
    return {"peak_rss_mb": round(rss / 2**20, 1), "wall_s": round(secs, 1), "log": r.stdout[-600:]}


def prepare(inp: Path, out: Path, *extra: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    res = timed([*LOOM, "data", "prepare", "--input", str(inp), "--out", str(out), *extra])
    meta = json.loads((out / "meta.json").read_text())
    res.update(
        {
            k: meta[k]
            for k in ("bytes", "documents", "vocab_size", "encoder", "encode_seconds", "bytes_per_token_val")
        }
    )
    res["tokens"] = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    return res


def val_text(out: Path, limit: int) -> list[str]:
    """Decoded documents of a prepared val split (up to `limit` characters)."""
    import numpy as np

    from loom.data.shards import read_shard
    from loom.data.tokenizers import load_tokenizer

    meta = json.loads((out / "meta.json").read_text())
    tok = load_tokenizer(out, meta)
    ids = np.concatenate([np.asarray(read_shard(p)) for p in sorted(out.glob("val_*.bin"))])
    cuts = [*np.flatnonzero(ids == tok.eot_id), len(ids)]
    docs, size = [], 0
    for a, b in zip(cuts, cuts[1:], strict=False):
        docs.append(tok.decode(ids[a + 1 : b].tolist()))
        size += len(docs[-1])
        if size >= limit:
            break
    return docs


def sample_texts(path: Path, limit: int, cap: int = 10_000) -> list[str]:
    out, size = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            t = json.loads(line)["text"][:cap]
            out.append(t)
            size += len(t)
            if size >= limit:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=500)
    ap.add_argument("--work", default="/tmp/loom-data-prepare")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu-2core-2026-11-23/data_prepare.json"))
    ap.add_argument("--only", default="", help="comma-separated steps (1-5) to run; default all")
    ap.add_argument("--formats", default="jsonl_gz,jsonl_zst,parquet,text_1gb", help="step 2's inputs")
    args = ap.parse_args()
    steps = {int(s) for s in args.only.split(",") if s} or {1, 2, 3, 4, 5}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"machine": "2 shared CPU cores (other jobs running)", "mb": args.mb}
    out_path = Path(args.out)
    if out_path.is_file():
        res = {**json.loads(out_path.read_text()), **res}

    def save():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1), flush=True)

    try:
        one, two = work / "c1" / "corpus.jsonl", work / "c2" / "corpus.jsonl"
        one.parent.mkdir(exist_ok=True)
        if not one.is_file():
            res["corpus_bytes"] = build_jsonl(one, args.mb * 10**6)
        if 1 in steps:  # 2x: the first 2 x --mb MB of the same files (no repeated text)
            two.parent.mkdir(exist_ok=True)
            res["corpus_2x_bytes"] = build_jsonl(two, 2 * args.mb * 10**6)
            bpe = ["--tokenizer", "bpe", "--vocab-size", "32768"]
            res["prepare_1x"] = prepare(one, work / "o1", *bpe)
            res["prepare_2x"] = prepare(two, work / "o2", *bpe)
            shutil.rmtree(work / "o2")
            shutil.rmtree(two.parent)
            res["rss_2x_over_1x"] = round(
                res["prepare_2x"]["peak_rss_mb"] / res["prepare_1x"]["peak_rss_mb"], 3
            )
            save()
        tok = str(work / "o1" / "tokenizer.json")
        if not Path(tok).is_file():  # step 2 alone: a BPE of the same size, trained on a 50 MB sample
            from loom.data.tokenizers import HFTokenizer

            (work / "o1").mkdir()
            HFTokenizer.train(sample_texts(one, 50 * 10**6), 32768).save(work / "o1")
        if 2 in steps:
            gz, zst, pq_path, txt = (
                work / "c.jsonl.gz",
                work / "c.jsonl.zst",
                work / "c.parquet",
                work / "one.txt",
            )
            with open(one, "rb") as f, gzip.open(gz, "wb", compresslevel=3) as g:
                shutil.copyfileobj(f, g, 1 << 22)
            import zstandard

            with open(one, "rb") as f, open(zst, "wb") as g:
                zstandard.ZstdCompressor(level=3).copy_stream(f, g)
            import pyarrow as pa
            import pyarrow.parquet as pq

            writer = None
            batch: list[str] = []
            with open(one, encoding="utf-8") as f:
                for line in [*f, None]:
                    if line is not None:
                        batch.append(json.loads(line)["text"])
                    if batch and (line is None or len(batch) >= 2000):
                        table = pa.table({"text": batch})
                        writer = writer or pq.ParquetWriter(pq_path, table.schema)
                        writer.write_table(table)
                        batch = []
            writer.close()
            with open(
                txt, "w", encoding="utf-8"
            ) as g:  # one text file of at least 1 GB (the corpus repeated)
                for _ in range(-(-(10**9) // one.stat().st_size)):
                    with open(one, encoding="utf-8") as f:
                        for line in f:
                            g.write(json.loads(line)["text"])
            for name, path in (("jsonl_gz", gz), ("jsonl_zst", zst), ("parquet", pq_path), ("text_1gb", txt)):
                if name not in args.formats.split(","):
                    path.unlink()
                    continue
                res[f"prepare_{name}"] = prepare(path, work / "o3", "--tokenizer", tok)
                res[f"prepare_{name}"]["input_bytes"] = path.stat().st_size
                shutil.rmtree(work / "o3")
                path.unlink()
                save()
        if 3 in steps:
            res["encode_speed"] = encode_speed(tok, sample_texts(one, 50 * 10**6))
            save()
        if 4 in steps:
            res["bpe_training"] = training_speed(
                sample_texts(one, 200 * 10**6), sample_texts(one, 50 * 10**6)
            )
            save()
        if 5 in steps:
            res["tokens_per_byte"] = sample_vs_whole(one, work)
            save()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def encode_speed(tok_path: str, texts: list[str]) -> dict:
    from tokenizers import Tokenizer

    from loom.data.encode import Encoder, cpu_count, tiktoken_spec

    lib = Tokenizer.from_file(tok_path)
    spec = tiktoken_spec(lib.to_str())
    import tiktoken

    enc = tiktoken.Encoding(
        "loom",
        pat_str=spec["pattern"],
        special_tokens=spec["special"],
        mergeable_ranks={bytes.fromhex(k): v for k, v in spec["ranks"].items()},
    )
    del Encoder
    n = sum(len(t.encode()) for t in texts)
    t0 = time.perf_counter()
    a = [e.ids for e in lib.encode_batch(texts, add_special_tokens=False)]
    t_lib = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = enc.encode_ordinary_batch(texts, num_threads=cpu_count())
    t_tk = time.perf_counter() - t0
    return {
        "bytes": n,
        "tokenizers_encode_batch_s": round(t_lib, 2),
        "tiktoken_batch_s": round(t_tk, 2),
        "speedup": round(t_lib / t_tk, 2),
        "identical_ids": a == b,
        "threads": cpu_count(),
    }


def training_speed(texts200: list[str], texts50: list[str]) -> dict:
    import rustbpe

    from loom.data.encode import GPT2_PATTERN
    from loom.data.tokenizers import HFTokenizer

    out = {"sample_chars": sum(map(len, texts200))}
    t0 = time.perf_counter()
    r = rustbpe.Tokenizer()
    r.train_from_iterator(iter(texts200), 32767, pattern=GPT2_PATTERN)
    out["rustbpe_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    HFTokenizer.train(texts200, 32768, "gpt2", "rustbpe")
    out["loom_s"] = round(time.perf_counter() - t0, 1)
    out["small_sample_chars"] = sum(map(len, texts50))
    t0 = time.perf_counter()
    HFTokenizer.train(texts50, 32768, "gpt2", "rustbpe")
    out["loom_small_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    HFTokenizer.train(texts50, 32768, "gpt2", "tokenizers")
    out["tokenizers_trainer_small_s"] = round(time.perf_counter() - t0, 1)
    return out


def sample_vs_whole(one: Path, work: Path) -> dict:
    """Tokens per byte on 1x's val split: BPE trained on a 100 MB sample vs on all of 1x's train split."""
    out = {}
    for name, sample in (("sample_100mb", "100000000"), ("whole", str(10**12))):
        o = work / f"tpb_{name}"
        r = prepare(one, o, "--tokenizer", "bpe", "--vocab-size", "32768", "--tokenizer-sample", sample)
        out[name] = {
            "tokens_per_byte_val": round(1 / r["bytes_per_token_val"], 5),
            "peak_rss_mb": r["peak_rss_mb"],
            "wall_s": r["wall_s"],
        }
        shutil.rmtree(o)
    a, b = out["sample_100mb"]["tokens_per_byte_val"], out["whole"]["tokens_per_byte_val"]
    out["relative_difference"] = round(abs(a - b) / b, 4)
    return out


if __name__ == "__main__":
    main()
