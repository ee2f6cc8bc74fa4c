"""Load balance of loom's MoE family with no balancing, DeepSeek-V3's bias update and the aux loss (issue 32).

    python benchmarks/moe_balance.py [--steps 500] [--arms none,bias,aux] [--seed 0] [--out DIR]

One small mixture of experts (model.family=moe: 8 routed SwiGLU experts top-2 in every layer, each as wide as
the dense MLP would be; 4 layers, 128 wide, 4 heads, block 128, batch 16 sequences = 2,048 tokens a step)
trains --steps steps on the built-in corpus (the Python standard library, BPE 4096), fp32, with one thread
(OMP_NUM_THREADS=1), the same seed for every arm, one run after the other:
  none  no balancing at all
  bias  model.moe_bias_update_rate=--bias-rate (DeepSeek-V3's auxiliary-loss-free bias, 1e-3)
  aux   model.moe_aux_loss_coef=--aux-coef (the sequence-wise Switch-style balance loss, 1e-2)
Every step is logged (train.log_every=1): the trainer writes moe/{layer}/max_mean, the most tokens any expert of
that layer got over the mean (2,048 x 2 / 8 = 512), counted over the step's whole batch. Per arm this reports
that ratio averaged over layers and its maximum over layers, each averaged over the last --tail steps and over
the whole run, and the final val loss (train.eval_batches windows of the validation split, the same for every
arm; the aux arm's training loss includes its balance loss, its val loss does not).
Writes moe_balance.json (the figures, every arm's per-step ratios and val curve) and moe_balance.png (max/mean
against step) into --out.
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
ARMS = ("none", "bias", "aux")
COLORS = {"none": "tab:red", "bias": "tab:blue", "aux": "tab:green"}


def arm_args(arm: str, args) -> list[str]:
    if arm == "none":
        return []
    if arm == "bias":
        return [f"--model.moe_bias_update_rate={args.bias_rate}"]
    if arm == "aux":
        return [f"--model.moe_aux_loss_coef={args.aux_coef}"]
    raise SystemExit(f"unknown arm '{arm}' (choose from {', '.join(ARMS)})")


def common(args) -> list[str]:
    return [
        "--model.family=moe",
        "--model.n_experts=8",
        "--model.moe_top_k=2",
        f"--model.n_layer={args.n_layer}",
        "--model.n_head=4",
        f"--model.n_embd={args.n_embd}",
        f"--model.block_size={args.block_size}",
        f"--train.batch_size={args.batch_size}",
        f"--train.steps={args.steps}",
        "--train.log_every=1",
        f"--train.eval_every={args.eval_every}",
        f"--train.eval_batches={args.eval_batches}",
        "--train.ckpt_every=0",
        "--train.sample_every=0",
        f"--optim.warmup_steps={max(1, args.steps // 10)}",
        "--precision.dtype=fp32",
        "--train.device=cpu",
        f"--run.seed={args.seed}",
        f"--run.dir={args.runs}",
    ]


def run(arm: str, args) -> float:
    """Train one arm (in the foreground, one thread); its wall time in seconds."""
    if args.reuse and summary_of(args.runs / arm) is not None:
        print(f"{arm}: reusing {args.runs / arm}", flush=True)
        return float("nan")
    cmd = [sys.executable, "-m", "loom", "train", *common(args), *arm_args(arm, args), f"--run.name={arm}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    with open(args.runs / f"{arm}.log", "w") as log:
        rc = subprocess.run(
            [*cmd, "--force"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    if rc != 0:
        raise SystemExit(f"arm {arm} failed (exit {rc}): see {args.runs / f'{arm}.log'}\n  {' '.join(cmd)}")
    return time.time() - t0


def summary_of(run_dir: Path) -> dict | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "summary" in rec:
            return rec["summary"]
    return None


def result(arm: str, args, wall_s: float) -> dict:
    run_dir = args.runs / arm
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "moe/max_mean" in r]
    layers = sorted({int(k.split("/")[1]) for k in steps[0] if k.startswith("moe/") and k.count("/") == 2})
    mean_over_layers = [statistics.mean(r[f"moe/{i}/max_mean"] for i in layers) for r in steps]
    max_over_layers = [r["moe/max_mean"] for r in steps]
    tail = slice(-args.tail, None)
    val = sorted(
        {r["step"]: r["val_loss"] for r in recs if r.get("val_loss") is not None and "step" in r}.items()
    )
    return {
        "arm": arm,
        "extra_args": arm_args(arm, args),
        "params": json.loads((run_dir / "run.json").read_text())["params"],
        "steps_logged": len(steps),
        "max_mean_layer_avg": {
            "last": statistics.mean(mean_over_layers[tail]),
            "whole": statistics.mean(mean_over_layers),
        },
        "max_mean_layer_max": {
            "last": statistics.mean(max_over_layers[tail]),
            "whole": statistics.mean(max_over_layers),
        },
        "per_layer_last": {i: statistics.mean(r[f"moe/{i}/max_mean"] for r in steps[tail]) for i in layers},
        "balance_layer_avg_last": statistics.mean(
            statistics.mean(r[f"moe/{i}/balance"] for i in layers) for r in steps[tail]
        ),
        "bias_norm_final": [steps[-1][f"moe/{i}/bias_norm"] for i in layers],
        "final_val_loss": summary_of(run_dir)["val_loss"],
        "final_train_loss": statistics.mean(r["loss"] for r in steps[tail]),
        "step_s_median": statistics.median(r["dt"] for r in steps),
        "wall_s": round(wall_s, 1),
        "val_curve": val,
        "curve_step": [r["step"] for r in steps],
        "curve_layer_avg": [round(v, 4) for v in mean_over_layers],
        "curve_layer_max": [round(v, 4) for v in max_over_layers],
    }


def rolling(v: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x - (v[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def plot(results: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, what in (
        (axes[0], "curve_layer_avg", "mean over the layers"),
        (axes[1], "curve_layer_max", "max over the layers"),
    ):
        for r in results:
            c = COLORS[r["arm"]]
            ax.plot(r["curve_step"], r[key], color=c, alpha=0.2, lw=0.7)
            label = f"{r['arm']} {' '.join(a.lstrip('-') for a in r['extra_args'])}".strip()
            stat = r["max_mean_layer_avg" if key == "curve_layer_avg" else "max_mean_layer_max"]
            ax.plot(
                r["curve_step"],
                rolling(r[key], args.smooth),
                color=c,
                label=f"{label}: last {args.tail} {stat['last']:.3f}, val {r['final_val_loss']:.3f}",
            )
        ax.axhline(1.0, color="grey", ls="--", lw=1)
        ax.set_xlabel("step")
        ax.set_title(f"tokens-per-expert max/mean, {what} ({args.smooth}-step mean; raw faint)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("max / mean tokens per expert (1 = balanced)")
    fig.suptitle(
        f"loom MoE, {args.n_layer} layers x 8 experts top-2, {args.n_embd} wide, {args.steps} steps, seed "
        f"{args.seed}, built-in corpus, 1 CPU thread",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--arms", default="none,bias,aux")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--aux-coef", type=float, default=1e-2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=40)
    p.add_argument("--tail", type=int, default=100, help="steps at the end that the 'last' figures average")
    p.add_argument("--smooth", type=int, default=10, help="plot: steps of the rolling mean")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu-2core-2026-11-25")
    p.add_argument("--runs", type=Path, default=Path("/tmp/loom-moe-balance"))
    p.add_argument("--reuse", action="store_true", help="keep an arm whose run in --runs finished")
    args = p.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    results = []
    for arm in args.arms.split(","):
        wall = run(arm, args)
        results.append(result(arm, args, wall))
        r = results[-1]
        print(
            f"{arm:5s} max/mean (layer avg) last {args.tail} {r['max_mean_layer_avg']['last']:.3f}, whole "
            f"{r['max_mean_layer_avg']['whole']:.3f} | (layer max) last {r['max_mean_layer_max']['last']:.3f}, "
            f"whole {r['max_mean_layer_max']['whole']:.3f} | val loss {r['final_val_loss']:.4f} | {wall:.0f}s",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": " ".join(sys.argv),
        "common_args": common(args),
        "tail_steps": args.tail,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "note": "2-core CPU shared with other jobs, one thread per run; max/mean is counted per step over the "
        "whole batch (2 x tokens choices over 8 experts)",
        "runs": results,
    }
    (args.out / "moe_balance.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, args, args.out / "moe_balance.png")
    print(f"wrote {args.out / 'moe_balance.json'} and {args.out / 'moe_balance.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
