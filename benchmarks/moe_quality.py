"""MoE against a dense Llama at equal active parameters and equal training time, on one CPU core (issue 32).

    python benchmarks/moe_quality.py [--budget-s 180] [--ffn 512] [--seeds 0,1,2] [--out DIR]

Two models on the built-in corpus (the Python standard library, BPE 4096), both 4 layers, 128 wide, 4 heads,
block 128, RoPE/RMSNorm/untied head (the llama preset), batch 16 sequences (2,048 tokens a step), fp32, AdamW
at loom's default learning rates:
  dense  model.family=llama, a SwiGLU MLP --ffn wide in every layer
  moe    model.family=moe: 8 routed SwiGLU experts of --ffn / 2 each, top-2, in every layer, balanced with
         DeepSeek-V3's bias update (model.moe_bias_update_rate=--bias-rate)
so a token passes through the same MLP matrices' worth of weights in both (2 x 3 x C x F/2 = 3 x C x F); the
MoE adds its router (C x 8 per layer) to the active count and holds 4x the MLP weights in all. The exact
counts (loom.model.flops.param_count / active_param_count of each run's config) go into the JSON.

Equal training time: loom has no wall-clock budget option, so a calibration first measures each model's
step time, and each model then gets the step count that fills --budget-s seconds of training at that step time,
with its cosine schedule (warm-up a tenth) ending at its last step. The step time is CPU time, not wall time:
the 2 cores are shared with other jobs whose load comes and goes, and a one-thread process's CPU seconds are
what its wall seconds would be on a core of its own. Each model trains --calib-short and --calib-steps steps
(dense, moe, moe, dense), and its step's CPU time is the difference of the two processes' CPU times (from
getrusage: start-up, the final evaluation and checkpoint cancel) over the difference of steps; the trainer's
own wall-clock step time (median, steps after the 3rd) is recorded beside it. Every run is one process with one thread (OMP_NUM_THREADS=1), one at a time, the two models of a
seed back to back (the order alternating over seeds). Val loss is evaluated --eval-points times per run and at
the end, on the same train.eval_batches windows of the validation split for every run. Reported per model:
final val loss (mean, stdev over seeds), steps, tokens seen, the step-time ratio (calibrated, and measured over
the runs themselves) and the training seconds actually spent. Writes moe_quality.json and moe_quality.png (val
loss against training time and against tokens) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("dense", "moe")
COLORS = {"dense": "tab:blue", "moe": "tab:red"}


def shape(model: str, args) -> list[str]:
    if model == "dense":
        return ["--model.family=llama", f"--model.ffn_hidden={args.ffn}"]
    return [
        "--model.family=moe",
        "--model.n_experts=8",
        "--model.moe_top_k=2",
        f"--model.moe_ffn_hidden={args.ffn // 2}",
        f"--model.moe_bias_update_rate={args.bias_rate}",
    ]


def common(args) -> list[str]:
    return [
        f"--model.n_layer={args.n_layer}",
        "--model.n_head=4",
        f"--model.n_embd={args.n_embd}",
        f"--model.block_size={args.block_size}",
        f"--train.batch_size={args.batch_size}",
        "--train.log_every=1",
        "--train.ckpt_every=0",
        "--train.sample_every=0",
        "--precision.dtype=fp32",
        "--train.device=cpu",
        f"--run.dir={args.runs}",
    ]


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train(name: str, model: str, extra: list[str], args) -> tuple[float, float]:
    """One `loom train` in the foreground with one thread: (wall seconds, CPU seconds of the process)."""
    run_dir = args.runs / name
    timing = args.runs / f"{name}.time.json"
    if args.reuse and summary_of(run_dir) is not None and timing.is_file():
        print(f"{name}: reusing {run_dir}", flush=True)
        t = json.loads(timing.read_text())
        return t["wall_s"], t["cpu_s"]
    cmd = [
        sys.executable,
        "-m",
        "loom",
        "train",
        *shape(model, args),
        *common(args),
        *extra,
        f"--run.name={name}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    t0, c0 = time.time(), cpu_children()
    with open(args.runs / f"{name}.log", "w") as log:
        rc = subprocess.run(
            [*cmd, "--force"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}): see {args.runs / f'{name}.log'}\n  {' '.join(cmd)}")
    wall, cpu = time.time() - t0, cpu_children() - c0
    timing.write_text(json.dumps({"wall_s": wall, "cpu_s": cpu}))
    return wall, cpu


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary_of(run_dir: Path) -> dict | None:
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    return next((r["summary"] for r in records(run_dir) if "summary" in r), None)


def step_times(run_dir: Path) -> list[float]:
    """The trainer's per-step wall time (log_every=1), the first 3 steps (warm-up, allocation) left out."""
    return [r["dt"] for r in records(run_dir) if "dt" in r and r.get("step", 0) > 3]


def param_counts(run_dir: Path) -> dict:
    """Total and active parameters of a run's model, from its saved config (loom.model.flops)."""
    from loom.config import load_config
    from loom.model.flops import active_param_count, param_count
    from loom.model.registry import spec_of

    cfg = load_config(run_dir / "config.toml")
    data_dir = Path(json.loads((run_dir / "run.json").read_text())["data_dir"])
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]
    mcfg = spec_of(cfg).config(cfg, vocab)
    total, active = param_count(mcfg), active_param_count(mcfg)
    emb = mcfg.padded_vocab * mcfg.n_embd * (1 if mcfg.tie_embeddings else 2)
    return {"total": total, "active": active, "active_non_embedding": active - emb}


def calibrate(args) -> dict:
    """Each model's CPU seconds per step (the difference of a long and a short run) and wall median."""
    cpu: dict[str, dict[int, float]] = {m: {} for m in MODELS}
    wall_median = {}
    for model, n in (
        ("dense", args.calib_short),
        ("moe", args.calib_short),
        ("moe", args.calib_steps),
        ("dense", args.calib_steps),
    ):
        name = f"cal-{model}-{n}"
        extra = [
            f"--train.steps={n}",
            "--train.eval_every=0",
            "--train.eval_batches=1",
            "--optim.warmup_steps=5",
        ]
        _, cpu[model][n] = train(name, model, extra, args)
        if n == args.calib_steps:
            wall_median[model] = statistics.median(step_times(args.runs / name))
    step_s = {
        m: (c[args.calib_steps] - c[args.calib_short]) / (args.calib_steps - args.calib_short)
        for m, c in cpu.items()
    }
    print(
        "calibration: "
        + ", ".join(
            f"{m} {1e3 * s:.0f} ms CPU/step ({1e3 * wall_median[m]:.0f} ms wall)" for m, s in step_s.items()
        ),
        flush=True,
    )
    return {"cpu_s": cpu, "step_s": step_s, "wall_step_s_median": wall_median}


def result(name: str, model: str, seed: int, steps: int, wall_s: float, cpu_s: float, args) -> dict:
    run_dir = args.runs / name
    recs = records(run_dir)
    dts = [r["dt"] for r in recs if "dt" in r]
    curve = sorted(
        {r["step"]: r["val_loss"] for r in recs if r.get("val_loss") is not None and "step" in r}.items()
    )
    last = [r for r in recs if "moe/max_mean" in r][-args.tail :]
    out = {
        "model": model,
        "seed": seed,
        "steps": steps,
        "tokens": steps * args.batch_size * args.block_size,
        "final_val_loss": summary_of(run_dir)["val_loss"],
        "val_curve": curve,
        "train_s": round(sum(dts), 1),
        "step_s_median": statistics.median(step_times(run_dir)),
        "wall_s": round(wall_s, 1),
        "cpu_s": round(cpu_s, 1),
    }
    if last:
        out["moe_max_mean_last"] = statistics.mean(r["moe/max_mean"] for r in last)
    return out


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for model in MODELS:
        runs = [r for r in doc["runs"] if r["model"] == model]
        s = doc["summary"][model]
        steps = [st for st, _ in runs[0]["val_curve"]]
        vals = [[dict(r["val_curve"])[st] for r in runs] for st in steps]
        mean = [statistics.mean(v) for v in vals]
        lo, hi = [min(v) for v in vals], [max(v) for v in vals]
        label = (
            f"{model}: {s['active']:,} active / {s['total']:,} params, {s['steps']} steps; "
            f"val {s['val_mean']:.4f} ± {s['val_stdev']:.4f}"
        )
        for ax, x in (
            (axes[0], [st * doc["calibration"]["step_s"][model] for st in steps]),
            (axes[1], [st * doc["tokens_per_step"] / 1e6 for st in steps]),
        ):
            ax.fill_between(x, lo, hi, color=COLORS[model], alpha=0.2)
            ax.plot(x, mean, color=COLORS[model], marker="o", ms=3, label=label)
    axes[0].set_xlabel("training time at the calibrated CPU step time (s, one thread)")
    axes[1].set_xlabel("tokens seen (millions)")
    axes[0].set_ylabel("val loss (nats/token, BPE 4096)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(top=min(ax.get_ylim()[1], 7.0))
    fig.suptitle(
        f"MoE (8 experts top-2, width {doc['ffn'] // 2}) vs dense SwiGLU (width {doc['ffn']}) at equal active "
        f"params and {doc['budget_s']:.0f} s of training each; {len(runs)} seeds: mean, min-max band",
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
    p.add_argument("--budget-s", type=float, default=180.0, help="training seconds per run")
    p.add_argument("--ffn", type=int, default=512, help="the dense SwiGLU width; each expert gets half")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--bias-rate", type=float, default=1e-3)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--calib-steps", type=int, default=45)
    p.add_argument("--calib-short", type=int, default=5)
    p.add_argument("--eval-points", type=int, default=8, help="evaluations per run besides the final one")
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--tail", type=int, default=100, help="steps at the end of the MoE's max/mean average")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cpu-2core-2026-11-25")
    p.add_argument("--runs", type=Path, default=Path("/tmp/loom-moe-quality"))
    p.add_argument("--reuse", action="store_true", help="keep runs in --runs that finished")
    args = p.parse_args()
    if args.ffn % 2:
        raise SystemExit("--ffn must be even (each expert is --ffn / 2 wide)")
    args.runs.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    cal = calibrate(args)
    steps = {m: max(20, round(args.budget_s / s)) for m, s in cal["step_s"].items()}
    print(f"steps for {args.budget_s:.0f}s: {steps}", flush=True)
    results = []
    seeds = [int(s) for s in args.seeds.split(",")]
    for k, seed in enumerate(seeds):
        for model in MODELS if k % 2 == 0 else MODELS[::-1]:
            n = steps[model]
            extra = [
                f"--train.steps={n}",
                f"--train.eval_every={max(1, n // args.eval_points)}",
                f"--train.eval_batches={args.eval_batches}",
                f"--optim.warmup_steps={max(1, n // 10)}",
                f"--run.seed={seed}",
            ]
            wall, cpu = train(f"{model}-s{seed}", model, extra, args)
            results.append(result(f"{model}-s{seed}", model, seed, n, wall, cpu, args))
            r = results[-1]
            print(
                f"{model:5s} seed {seed}: {n} steps, val loss {r['final_val_loss']:.4f}, process CPU {cpu:.0f}s, "
                f"wall {wall:.0f}s (train steps {r['train_s']:.0f}s, median step {1e3 * r['step_s_median']:.0f} ms)",
                flush=True,
            )
    summary = {}
    for model in MODELS:
        runs = [r for r in results if r["model"] == model]
        finals = [r["final_val_loss"] for r in runs]
        summary[model] = {
            **param_counts(args.runs / f"{model}-s{seeds[0]}"),
            "steps": steps[model],
            "tokens": runs[0]["tokens"],
            "val_mean": statistics.mean(finals),
            "val_stdev": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "val_finals": finals,
            "train_wall_s_mean": statistics.mean(r["train_s"] for r in runs),
            "process_cpu_s_mean": statistics.mean(r["cpu_s"] for r in runs),
            "wall_step_s_measured": statistics.median(r["step_s_median"] for r in runs),
        }
    summary["moe_minus_dense_val"] = summary["moe"]["val_mean"] - summary["dense"]["val_mean"]
    summary["step_time_ratio_calibrated"] = cal["step_s"]["moe"] / cal["step_s"]["dense"]
    summary["step_time_ratio_calibrated_wall"] = (
        cal["wall_step_s_median"]["moe"] / cal["wall_step_s_median"]["dense"]
    )
    summary["step_time_ratio_runs_wall"] = (
        summary["moe"]["wall_step_s_measured"] / summary["dense"]["wall_step_s_measured"]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": " ".join(sys.argv),
        "common_args": common(args),
        "shapes": {m: shape(m, args) for m in MODELS},
        "ffn": args.ffn,
        "budget_s": args.budget_s,
        "tokens_per_step": args.batch_size * args.block_size,
        "calibration": cal,
        "summary": summary,
        "runs": results,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "note": "2-core CPU shared with other jobs, one thread per run, one run at a time; equal time means equal "
        "steps x calibrated CPU step time; train_s (the trainer's wall step times summed) and cpu_s (the whole "
        "process, start-up and evaluations included) say what the runs actually took",
    }
    (args.out / "moe_quality.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, args.out / "moe_quality.png")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'moe_quality.json'} and {args.out / 'moe_quality.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
