"""FP8 against bf16 at equal steps on the built-in corpus (issue 31's recipe and its CPU acceptance).

    python benchmarks/fp8_vs_bf16.py [--steps 300] [--seeds 0,1,2] [--recipe tensorwise] [--dtype bf16]
                                     [--batch-size 16] [--out DIR]

Both arms are `loom train` with no data given (the built-in corpus) and the demo model (4 layers, 192 wide,
block 128, batch --batch-size), --dtype autocast (bf16; fp32: none) with fp32 master weights; the fp8 arm adds
precision.fp8=RECIPE with
fp8_filter=all (every linear whose dimensions are multiples of 16, all of them here: the demo model is far below
the sizes where fp8 gains speed on a GPU, so `auto` would convert none). The two arms of a seed run side by
side, one thread each, and only losses are compared (a CPU emulates float8 matmuls: its times say nothing).
Writes fp8_vs_bf16.json (final val losses, mean and spread per arm, the relative gap) and, through `loom plot`,
fp8_vs_bf16.png (every run's train and val loss overlaid) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def arms(recipe: str, dtype: str) -> dict[str, list[str]]:
    return {
        dtype: [],
        f"fp8-{recipe}": [f"--precision.fp8={recipe}", "--precision.fp8_filter=all"],
    }


def start(arm: str, flags: list[str], seed: int, args) -> subprocess.Popen:
    cmd = [
        *(sys.executable, "-m", "loom", "train"),
        *flags,
        f"--precision.dtype={args.dtype}",
        f"--train.batch_size={args.batch_size}",
        "--train.device=cpu",
        f"--train.steps={args.steps}",
        f"--train.eval_every={args.eval_every}",
        "--train.log_every=10",
        "--train.ckpt_every=0",
        "--train.sample_every=0",
        f"--run.seed={seed}",
        f"--run.dir={args.runs}",
        f"--run.name={arm}-s{seed}",
        "--force",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    log = open(args.runs / f"{arm}-s{seed}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def final_val(run: Path) -> float:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in recs if r.get("val_loss") is not None][-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="both arms' precision.dtype")
    p.add_argument("--batch-size", type=int, default=16, help="train.batch_size (the demo's: 16)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu-2core-2026-11-25")
    p.add_argument("--runs", type=Path, default=Path("/tmp/loom-fp8-vs-bf16"))
    args = p.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    finals: dict[str, list[float]] = {arm: [] for arm in arms(args.recipe, args.dtype)}
    for seed in (int(s) for s in args.seeds.split(",")):
        procs = {arm: start(arm, flags, seed, args) for arm, flags in arms(args.recipe, args.dtype).items()}
        for arm, proc in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"{arm} seed {seed} failed: see {args.runs / f'{arm}-s{seed}.log'}")
            finals[arm].append(final_val(args.runs / f"{arm}-s{seed}"))
            print(f"{arm} seed {seed}: final val loss {finals[arm][-1]:.4f}", flush=True)
    summary = {
        arm: {
            "mean": statistics.mean(v),
            "min": min(v),
            "max": max(v),
            "stdev": statistics.stdev(v) if len(v) > 1 else 0.0,
            "finals": v,
        }
        for arm, v in finals.items()
    }
    base, fp8 = (summary[a]["mean"] for a in finals)
    summary["fp8_vs_base_relative"] = (fp8 - base) / base
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [str(args.runs / f"{arm}-s{s}") for arm in finals for s in args.seeds.split(",")]
    subprocess.run(
        [sys.executable, "-m", "loom", "plot", *runs, "--out", str(args.out / "fp8_vs_bf16.png")], check=True
    )
    doc = {"command": " ".join(sys.argv), "steps": args.steps, "dtype": args.dtype, "summary": summary}
    (args.out / "fp8_vs_bf16.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
