"""Data-parallel step time and weak scaling on CPU, all measured in one run.

1. Step time of the MPI synchronisers (naive, bucketed) against torch DDP, 2 ranks, same model and batch.
2. Weak scaling: 2 ranks x 1 thread at global batch B against 1 rank x 1 thread at B/2 (each rank does the
   same work); efficiency = tokens/s(2 ranks) / (2 x tokens/s(1 rank)).

Model: nanoGPT's shakespeare_char shape (6 layers, 6 heads, 384 wide, block 256; ~10.7M parameters) on a
char-level slice of the standard library. Step times are medians over the steps after the first `--skip`.

    python benchmarks/dp_scaling.py [--steps 12] [--batch 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loom.data.corpus import python_stdlib_files
from loom.data.prepare import prepare
from loom.launch.commands import local_mpiexec
from loom.metrics import read_jsonl

MODEL = ["--model.n_layer=6", "--model.n_head=6", "--model.n_embd=384", "--model.block_size=256"]


def run(name: str, mpi_ranks: int, extra: list[str], common: list[str], run_dir: Path) -> list[dict]:
    """One training run with 1 thread per process (under mpiexec when mpi_ranks > 0); its metrics records."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "loom", "train", f"--run.name={name}", *common, *extra]
    if mpi_ranks:
        argv = local_mpiexec(argv, mpi_ranks)
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    return read_jsonl(run_dir / name / "metrics.jsonl")


def summarise(recs: list[dict], skip: int) -> dict:
    steps = [r for r in recs if "loss" in r][skip:]
    dt = statistics.median(r["dt"] for r in steps)
    return {"dt_s": dt, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences) of the 2-rank runs")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="loom-dp-bench-"))
    data = tmp / "data"
    prepare(python_stdlib_files()[:40], data, tokenizer="char", seed=0)
    common = [
        f"--data.path={data}",
        f"--run.dir={tmp}",
        *MODEL,
        f"--train.steps={args.steps}",
        "--train.log_every=1",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.ckpt_every=0",
        "--train.eval_batches=1",
        "--train.device=cpu",
    ]
    two = [f"--train.batch_size={args.batch}"]
    results = {
        "ddp": summarise(
            run("ddp", 0, ["--nproc=2", "--parallel.dp_impl=ddp", *two], common, tmp), args.skip
        ),
        "mpi-naive": summarise(
            run("naive", 2, ["--parallel.dp_impl=mpi", "--parallel.mpi_sync=naive", *two], common, tmp),
            args.skip,
        ),
        "mpi-bucketed": summarise(
            run("bucketed", 2, ["--parallel.dp_impl=mpi", "--parallel.mpi_sync=bucketed", *two], common, tmp),
            args.skip,
        ),
        "1rank-half-batch": summarise(
            run("one", 0, ["--parallel.dp_impl=none", f"--train.batch_size={args.batch // 2}"], common, tmp),
            args.skip,
        ),
    }
    ddp, naive, bucketed, one = (results[k] for k in ("ddp", "mpi-naive", "mpi-bucketed", "1rank-half-batch"))
    ratios = {
        "bucketed_over_naive": bucketed["dt_s"] / naive["dt_s"],
        "bucketed_over_ddp": bucketed["dt_s"] / ddp["dt_s"],
        "weak_scaling_efficiency_ddp": ddp["tokens_per_s"] / (2 * one["tokens_per_s"]),
    }
    print(f"{'run':<18} {'step time (s)':>14} {'tokens/s':>10}")
    for k, v in results.items():
        print(f"{k:<18} {v['dt_s']:>14.3f} {v['tokens_per_s']:>10.0f}")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
