"""Start time of `loom train` on a large llm.c-format directory without meta.json (issue 19).

    python benchmarks/data_start.py [--gb 2] [--out benchmarks/results/cpu-2core-2026-11-23/data_start.json]

Generates llm.c shards (uint16, GPT-2 ids, FineWeb file names, 100M tokens each) of about --gb GB in a
temporary folder, then measures, back to back:
  - what training does with the data before its first step (check the directory, open the loader and the
    val set, read the first batch; block 1024), in this process, on that directory and on a tiny one;
  - the whole `loom train` command (a 1-layer model, one step, torch import included) for context;
  - what the start cost before issue 19: a scan of every token for the vocabulary (formats.id_range);
  - `loom data inspect --write-meta` (one full scan, once), and the start after it.
The generated data is deleted at the end. Files are in the page cache (just written): warm-cache figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LOOM = [sys.executable, "-m", "loom"]


def write_dir(d: Path, shards: int, tokens: int) -> None:
    from loom.data.shards import write_shard

    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(shards + 1):
        name = f"fineweb_val_{i:06d}.bin" if i == 0 else f"fineweb_train_{i:06d}.bin"
        ids = rng.integers(0, 50257, size=tokens, dtype=np.uint16)
        ids[::1000] = 50256  # end-of-text every 1000 tokens
        write_shard(d / name, ids, version=1)


def train_seconds(data: Path, runs: Path) -> float:
    cmd = [
        *LOOM,
        "train",
        f"--data.path={data}",
        "--model.vocab_size=50304",
        "--model.n_layer=1",
        "--model.n_head=1",
        "--model.n_embd=32",
        "--model.block_size=32",
        "--train.batch_size=2",
        "--train.steps=1",
        "--train.eval_every=0",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.sample_tokens=1",
        "--train.ckpt_every=0",
        "--train.log_every=1",
        "--train.device=cpu",
        f"--run.dir={runs}",
    ]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    dt = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"loom train failed:\n{r.stdout}\n{r.stderr}")
    return dt


def median(fn, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def data_start(d: Path) -> float:
    """What `loom train` does with the data before its first step: check the directory (meta or no meta),
    open the train loader and the val set, read the first batch (median of 3, in this process)."""
    from loom.data.loader import ShardLoader, ValSet
    from loom.train.setup import check_data_dir

    def start():
        check_data_dir(d)
        loader = ShardLoader(d, 8, 1024, seed=0)
        ValSet(d, 1024, 160)
        loader.next_batch()

    return median(start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cpu-2core-2026-11-23/data_start.json"))
    args = ap.parse_args()
    from loom.data.formats import id_range, open_split

    tmp = Path(tempfile.mkdtemp(prefix="loom-data-start-"))
    try:
        per = 100_000_000
        shards = max(1, round(args.gb * 1e9 / (2 * per)) - 1)
        big, tiny = tmp / "big", tmp / "tiny"
        write_dir(big, shards, per)
        write_dir(tiny, 1, 100_000)
        size = sum(p.stat().st_size for p in big.iterdir())
        res = {"data_bytes": size, "shards": shards + 1, "cache": "warm (just written)"}
        res["data_start_tiny_s"] = data_start(tiny)
        res["data_start_big_no_meta_s"] = data_start(big)
        res["train_command_big_no_meta_s"] = train_seconds(big, tmp / "runs")
        res["full_scan_s_before_issue19"] = median(
            lambda: id_range([a for s in ("train", "val") for a in open_split(big, s)])
        )
        t0 = time.perf_counter()
        subprocess.run(
            [*LOOM, "data", "inspect", str(big), "--write-meta", "--sample-tokens", "0"],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        res["inspect_write_meta_s"] = time.perf_counter() - t0
        res["data_start_big_with_meta_s"] = data_start(big)
        res["train_command_big_with_meta_s"] = train_seconds(big, tmp / "runs")
        res["train_command_tiny_s"] = train_seconds(tiny, tmp / "runs")
        print(json.dumps(res, indent=1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
