"""Llama-family blocks against GPT-2's at the same parameter count, steps, data and optimizer (issue 20).

    python benchmarks/llama_vs_gpt2.py [--steps 400] [--seeds 0,1,2] [--out DIR]

Both train with `loom train` on the built-in corpus (the Python standard library, byte-level BPE of 1,024
tokens, so the embeddings do not dominate a model this small), fp32, one process each with one thread; the two
families of a seed run side by side, so a machine that gets busier affects both alike (only losses are
compared, never times). The shapes:
  gpt2   4 layers, 4 heads, 128 wide, learned positions, LayerNorm, GELU MLP 512 wide, tied head: 926,848 params
  llama  model.family=llama: RoPE, RMSNorm, SwiGLU 304 wide, 2 key/value heads for 4 query heads, untied head:
         926,848 params too (the SwiGLU width is picked to match GPT-2's count; the 8/3 rule would give 384)
Each run evaluates val loss every --eval-every steps on the same fixed windows. Writes llama_vs_gpt2.json
(every curve, final val losses, mean and spread over seeds) and llama_vs_gpt2.png (both families' curves,
mean with a min-max band) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "gpt2": ["--model.n_layer=4", "--model.n_head=4", "--model.n_embd=128"],
    "llama": [
        "--model.family=llama",
        "--model.n_layer=4",
        "--model.n_head=4",
        "--model.n_kv_head=2",
        "--model.n_embd=128",
        "--model.ffn_hidden=304",
    ],
}


def common(args) -> list[str]:
    return [
        "--data.vocab_size=1024",
        "--model.block_size=64",
        "--train.batch_size=16",
        f"--train.steps={args.steps}",
        f"--train.eval_every={args.eval_every}",
        "--train.eval_batches=16",
        "--train.ckpt_every=0",
        "--train.sample_every=0",
        f"--train.log_every={args.eval_every}",
        "--optim.lr=2e-3",
        "--optim.min_lr=2e-4",
        f"--optim.warmup_steps={args.steps // 10}",
        "--precision.dtype=fp32",
        "--train.device=cpu",
        f"--run.dir={args.runs}",
    ]


def start(family: str, seed: int, args) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "loom",
        "train",
        *SHAPES[family],
        *common(args),
        f"--run.seed={seed}",
        f"--run.name={family}-s{seed}",
        "--force",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # two processes, no thread fights
    log = open(args.runs / f"{family}-s{seed}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def result(family: str, seed: int, args, wall_s: float) -> dict:
    name = f"{family}-s{seed}"
    recs = [json.loads(line) for line in (args.runs / name / "metrics.jsonl").read_text().splitlines()]
    params = json.loads((args.runs / name / "run.json").read_text())["params"]
    curve = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None and "step" in r]
    curve = sorted(dict(curve).items())
    return {
        "family": family,
        "seed": seed,
        "params": params,
        "curve": curve,
        "final": curve[-1][1],
        "wall_s": round(wall_s, 1),
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family, color in (("gpt2", "tab:blue"), ("llama", "tab:red")):
        runs = [r for r in results if r["family"] == family]
        steps = [s for s, _ in runs[0]["curve"]]
        vals = [[dict(r["curve"])[s] for r in runs] for s in steps]
        mean = [statistics.mean(v) for v in vals]
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.2)
        finals = ", ".join(f"{r['final']:.3f}" for r in runs)
        ax.plot(steps, mean, color=color, label=f"{family} ({runs[0]['params']:,} params): final {finals}")
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (nats/token, BPE 1024)")
    ax.set_title(f"llama vs GPT-2 blocks, same parameters and steps ({len(runs)} seeds: mean, min-max band)")
    ax.title.set_fontsize(9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu-2core-2026-11-23")
    p.add_argument("--runs", type=Path, default=Path("/tmp/loom-llama-vs-gpt2"))
    args = p.parse_args()
    results = []
    args.runs.mkdir(parents=True, exist_ok=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        t0 = time.time()
        procs = {family: start(family, seed, args) for family in ("gpt2", "llama")}
        for family, proc in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"{family} seed {seed} failed: see {args.runs / f'{family}-s{seed}.log'}")
            results.append(result(family, seed, args, time.time() - t0))
            print(f"{family} seed {seed}: final val loss {results[-1]['final']:.4f}", flush=True)
    summary = {}
    for family in ("gpt2", "llama"):
        finals = [r["final"] for r in results if r["family"] == family]
        summary[family] = {
            "final_mean": statistics.mean(finals),
            "final_min": min(finals),
            "final_max": max(finals),
            "final_stdev": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "finals": finals,
        }
    summary["llama_minus_gpt2"] = summary["llama"]["final_mean"] - summary["gpt2"]["final_mean"]
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": " ".join(sys.argv),
        "common_args": common(args),
        "shapes": SHAPES,
        "summary": summary,
        "runs": results,
        "note": "2-core CPU shared with other jobs: only losses are compared",
    }
    (args.out / "llama_vs_gpt2.json").write_text(json.dumps(doc, indent=1))
    plot(results, args.out / "llama_vs_gpt2.png")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
