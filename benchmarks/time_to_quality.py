"""Time to quality: loom's speedrun recipe against nanoGPT's own train.py, val loss against wall time.

    python benchmarks/time_to_quality.py --nanogpt PATH --text tinyshakespeare.txt [--seeds 1337,2,3]
        [--recipe configs/speedrun_shakespeare_char.toml] [--target 1.886] [--json out.json] [--png out.png]
    python benchmarks/time_to_quality.py --nanogpt PATH --text tinyshakespeare.txt \
        --variant 'no-bf16-ns=--optim.muon_ns_dtype=fp32' --variant 'old=configs/speedrun_old.toml' ...
    python benchmarks/time_to_quality.py --bpe [--budget-s 120] [--seeds 1337,2,3] ...

Tiny Shakespeare (char, the default): nanoGPT's CPU "baby GPT" (README settings, fp32, 2000 iterations, eval
every 250 on 20 batches; benchmarks/vs_nanogpt.py SHAPES["baby"]) and loom's recipe with each seed train on
the same data (nanoGPT's data/shakespeare_char, written from --text as its prepare.py does), interleaved as
vs_nanogpt.py does: one process runs at a time for --slice seconds while the others are stopped, and each
process's clock is its own running time from its start (imports and data loading included), so load from
elsewhere slows every side alike. Time to target: the running time at the first evaluation at or below
--target (1.886: nanoGPT's val loss after its 2000 iterations on this machine); nanoGPT evaluates every 250
iterations, so its time is that of the first such evaluation (if its run ends above the target, its final
evaluation's time is used: the target is defined as what its whole run reaches). loom evaluates every
--loom-eval-every steps, on as many windows as nanoGPT (20 x 12 of 64 tokens).
--variant NAME=ARGS (repeatable; the ablation): instead of the recipe alone, each variant with each seed, all
interleaved with the one nanoGPT run: ARGS are loom overrides on the recipe, or a config file first (then the
overrides). A variant named `recipe` with no ARGS is the recipe as it is. Each variant gets its own ratio.
--ablation-seeds S1,S2: the variants after the first run with these seeds only (a shorter ablation).

Built-in corpus (--bpe): the recipe (configs/speedrun_stdlib_bpe.toml) against loom's default GPT-2 config
on the Python-stdlib corpus with the BPE tokenizer, at equal running time: a short interleaved calibration
measures each config's step time, then each trains for --budget-s seconds' worth of steps (its LR schedule
complete), interleaved, and both are evaluated on the same validation windows with `loom eval` (val loss and
bits per byte). Every seed runs both. Both warm up over a tenth of their steps (the default's 100 warm-up
steps would be most of a short run's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vs_nanogpt import LOOM_EVAL, LOOM_STEP, NANO_EVAL, NANO_STEP, SHAPES, Runner, ensure_data, interleave

ROOT = Path(__file__).resolve().parent.parent
PY = [sys.executable, "-m", "loom"]
EVAL_LINE = re.compile(r"^val loss ([\d.]+) \| perplexity [\d.]+ \| bits per byte ([\d.]+)")


def time_to_target(evals: list[tuple[int, float, float]], target: float) -> tuple[float, int, bool] | None:
    """(running time, step, reached) at the first eval <= target; else the last eval's, reached False."""
    hit = next(((t, s, True) for s, v, t in evals if v <= target), None)
    if hit is None and evals:
        s, _, t = evals[-1]
        return t, s, False
    return hit


def shakespeare(args, work: Path) -> dict:
    nanogpt = args.nanogpt.resolve()
    if not (nanogpt / "train.py").is_file():
        raise SystemExit(f"{nanogpt} is not a nanoGPT checkout (no train.py)")
    data = ensure_data(nanogpt, args.text)
    spec, steps = SHAPES["baby"], 2000
    nano_argv = [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char.py",
        "--device=cpu",
        "--compile=False",
        "--dtype=float32",
        f"--out_dir={work / 'nanogpt'}",
        "--log_interval=1",
        "--eval_interval=250",
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        "--warmup_iters=100",
        *spec["nanogpt"],
    ]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    runners = [Runner("nanoGPT", nano_argv, nanogpt, NANO_STEP, NANO_EVAL, env)]
    variants = args.variant or [("loom", [])]
    seeds_of = {
        n: args.seeds if i == 0 else (args.ablation_seeds or args.seeds) for i, (n, _) in enumerate(variants)
    }
    for name, extra in variants:
        config, extra = (
            (extra[0], extra[1:]) if extra and not extra[0].startswith("--") else (args.recipe, extra)
        )
        for seed in seeds_of[name]:
            argv = [
                *PY,
                "train",
                str(ROOT / config),
                f"--data.path={data}",
                f"--run.dir={work}",
                f"--run.name={name}-seed{seed}",
                f"--run.seed={seed}",
                "--force",
                "--train.log_every=1",
                f"--train.eval_every={args.loom_eval_every}",
                "--train.sample_every=0",
                "--train.ckpt_every=0",
                *args.loom_arg,
                *extra,
            ]
            runners.append(Runner(f"{name} seed={seed}", argv, ROOT, LOOM_STEP, LOOM_EVAL, env))
    print(
        f"Tiny Shakespeare: nanoGPT baby GPT ({steps} iters) and loom {args.recipe} x {len(args.seeds)} seeds, "
        f"interleaved in slices of {args.slice:.0f}s ...",
        flush=True,
    )
    t0 = time.monotonic()
    interleave(runners, args.slice)
    out = {
        "mode": "shakespeare_char",
        "target": args.target,
        "recipe": args.recipe,
        "slice_s": args.slice,
        "wall_s": time.monotonic() - t0,
        "nanogpt_args": nano_argv[2:],
        "loom_args": runners[1].argv[3:],
        "variants": {name: extra for name, extra in variants},
        "threads": args.threads or "default",
        "runs": {},
    }
    for r in runners:
        hit = time_to_target(r.evals, args.target)
        out["runs"][r.name] = {
            "evals": [(s, v, round(t, 2)) for s, v, t in r.evals],
            "running_s": r.active,
            "time_to_target_s": hit[0] if hit else None,
            "step_at_target": hit[1] if hit else None,
            "reached": hit[2] if hit else False,
        }
    nano = out["runs"]["nanoGPT"]["time_to_target_s"]
    for name, _ in variants:
        runs = [out["runs"][f"{name} seed={seed}"] for seed in seeds_of[name]]
        ratios = [v["time_to_target_s"] / nano for v in runs if v["reached"] and nano]
        if ratios and len(ratios) == len(runs):
            key = "ratio_loom_over_nanogpt" if name == "loom" else f"ratio_{name}_over_nanogpt"
            out[key] = {
                "per_seed": ratios,
                "mean": statistics.mean(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
    return out


def _loom_eval(run: Path, data: Path, batches: int) -> tuple[float, float]:
    r = subprocess.run(
        [*PY, "eval", str(run), "--data", str(data), "--batches", str(batches), "--device", "cpu"],
        capture_output=True,
        text=True,
        check=True,
    )
    m = next(EVAL_LINE.match(line) for line in r.stdout.splitlines() if EVAL_LINE.match(line))
    return float(m.group(1)), float(m.group(2))


def bpe(args, work: Path) -> dict:
    """Recipe vs the default config on the built-in corpus at equal running time."""
    sides = {"default": [], "recipe": [str(ROOT / args.bpe_recipe)]}
    common = [
        f"--run.dir={work}",
        "--force",
        "--train.log_every=1",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.ckpt_every=0",
        *args.loom_arg,
    ]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    # 1. calibration: the median step of each side, interleaved
    cal = [
        Runner(
            n,
            [*PY, "train", *cfg, *common, f"--run.name=cal-{n}", f"--train.steps={args.calib_steps}"],
            ROOT,
            LOOM_STEP,
            LOOM_EVAL,
            env,
        )
        for n, cfg in sides.items()
    ]
    interleave(cal, args.slice)
    step_s = {}
    for r in cal:
        dts = [
            t1 - t0
            for (s0, t0, p0, _), (s1, t1, p1, _) in zip(r.steps, r.steps[1:], strict=False)
            if s1 == s0 + 1 and p1 == p0 and s0 > 3
        ]
        step_s[r.name] = statistics.median(dts)
    steps = {n: max(10, int(args.budget_s / s)) for n, s in step_s.items()}
    print(
        f"calibration: {', '.join(f'{n} {1e3 * s:.0f} ms/step -> {steps[n]} steps' for n, s in step_s.items())}",
        flush=True,
    )
    # 2. the runs, interleaved; then one evaluator on the same windows (the default's val set size)
    runners = []
    for seed in args.seeds:
        for n, cfg in sides.items():
            argv = [
                *PY,
                "train",
                *cfg,
                *common,
                f"--run.name={n}-seed{seed}",
                f"--run.seed={seed}",
                f"--train.steps={steps[n]}",
                f"--optim.warmup_steps={max(5, steps[n] // 10)}",
            ]
            runners.append(Runner(f"{n} seed={seed}", argv, ROOT, LOOM_STEP, LOOM_EVAL, env))
    interleave(runners, args.slice)
    out = {
        "mode": "stdlib_bpe",
        "budget_s": args.budget_s,
        "step_s": step_s,
        "steps": steps,
        "recipe": args.bpe_recipe,
        "runs": {},
    }
    for r, (seed, n) in zip(runners, [(sd, n) for sd in args.seeds for n in sides], strict=True):
        run = work / f"{n}-seed{seed}"
        data = Path(json.loads((run / "run.json").read_text())["data_dir"])
        loss, bpb = _loom_eval(run, data, args.eval_batches)
        out["runs"][r.name] = {
            "side": n,
            "seed": seed,
            "running_s": r.active,
            "steps": steps[n],
            "val_loss": loss,
            "val_bpb": bpb,
        }
    for n in sides:
        bpbs = [v["val_bpb"] for v in out["runs"].values() if v["side"] == n]
        out[n] = {
            "bpb_mean": statistics.mean(bpbs),
            "bpb_spread": max(bpbs) - min(bpbs),
            "loss_mean": statistics.mean(v["val_loss"] for v in out["runs"].values() if v["side"] == n),
        }
    return out


def plot(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (name, r) in enumerate(res["runs"].items()):
        t = [e[2] for e in r["evals"]]
        v = [e[1] for e in r["evals"]]
        color = "black" if name == "nanoGPT" else f"C{i}"
        ax.plot(t, v, marker="o", ms=3, color=color, label=name)
        if r["time_to_target_s"] is not None:
            ax.axvline(r["time_to_target_s"], color=color, ls=":", lw=1)
            ax.annotate(
                f"{r['time_to_target_s']:.0f}s",
                (r["time_to_target_s"], res["target"]),
                textcoords="offset points",
                xytext=(3, 8 + 10 * i),
                color=color,
                fontsize=8,
            )
    ax.axhline(res["target"], color="grey", ls="--", lw=1, label=f"target {res['target']}")
    ratio = res.get("ratio_loom_over_nanogpt")
    title = "Tiny Shakespeare (char): val loss vs running time, interleaved on one machine"
    if ratio:
        title += f"\nloom / nanoGPT time to target: {ratio['mean']:.2f}x (seeds {ratio['min']:.2f}-{ratio['max']:.2f})"
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("running time since process start (s)")
    ax.set_ylabel("val loss (each tool's own evaluation)")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def report(res: dict) -> None:
    if res["mode"] == "shakespeare_char":
        for name, r in res["runs"].items():
            t = r["time_to_target_s"]
            what = (
                f"{t:.1f}s (step {r['step_at_target']})" if r["reached"] else f"not reached (last eval {t}s)"
            )
            print(f"  {name:14s} val <= {res['target']}: {what}; ran {r['running_s']:.1f}s")
        for key, q in res.items():
            if key.startswith("ratio_") and key.endswith("_over_nanogpt"):
                who = key[len("ratio_") : -len("_over_nanogpt")]
                print(
                    f"  {who} / nanoGPT time to target: mean {q['mean']:.3f}x, seeds {q['min']:.3f}-{q['max']:.3f}x"
                )
        return
    for name, r in res["runs"].items():
        print(
            f"  {name:18s} {r['steps']:5d} steps in {r['running_s']:.1f}s: val loss {r['val_loss']:.4f}, "
            f"{r['val_bpb']:.4f} bits/byte"
        )
    for n in ("default", "recipe"):
        print(f"  {n}: bpb mean {res[n]['bpb_mean']:.4f}, seed spread {res[n]['bpb_spread']:.4f}")
    print(f"  recipe - default: {res['recipe']['bpb_mean'] - res['default']['bpb_mean']:+.4f} bits/byte")


def _variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition("=")
    if not name or " " in name or name == "nanoGPT":
        raise argparse.ArgumentTypeError(f"--variant NAME=ARGS, got {text!r}")
    return name, rest.split()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout (train.py); Tiny Shakespeare mode")
    p.add_argument(
        "--text", type=Path, help="Tiny Shakespeare text, used when nanoGPT's .bin files are missing"
    )
    p.add_argument("--recipe", default="configs/speedrun_shakespeare_char.toml")
    p.add_argument("--target", type=float, default=1.886)
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",") if x], default=[1337, 2, 3])
    p.add_argument(
        "--ablation-seeds",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=None,
        help="seeds of the variants after the first (default: --seeds)",
    )
    p.add_argument("--loom-eval-every", type=int, default=50)
    p.add_argument("--slice", type=float, default=3.0, help="seconds each process runs before the next")
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of every process (0: default)")
    p.add_argument("--loom-arg", action="append", default=[], help="extra loom override (repeatable)")
    p.add_argument(
        "--variant",
        action="append",
        type=_variant,
        default=[],
        help="NAME=ARGS: a variant of the recipe (loom overrides, or a config then overrides), repeatable",
    )
    p.add_argument("--bpe", action="store_true", help="built-in corpus: recipe vs default at equal time")
    p.add_argument("--bpe-recipe", default="configs/speedrun_stdlib_bpe.toml")
    p.add_argument("--budget-s", type=float, default=120.0, help="--bpe: running seconds per run")
    p.add_argument("--calib-steps", type=int, default=40)
    p.add_argument("--eval-batches", type=int, default=40, help="--bpe: loom eval --batches for both sides")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    args = p.parse_args()
    if not args.bpe and args.nanogpt is None:
        raise SystemExit(
            "give --nanogpt PATH (a nanoGPT checkout), or --bpe for the built-in corpus comparison"
        )
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_avg_start": os.getloadavg(),
        "python": sys.version.split()[0],
    }
    with tempfile.TemporaryDirectory(prefix="loom-ttq-") as tmp:
        res = bpe(args, Path(tmp)) if args.bpe else shakespeare(args, Path(tmp))
    meta["load_avg_end"] = os.getloadavg()
    res["meta"] = meta
    report(res)
    print(
        f"load average at start {meta['load_avg_start']}, at end {meta['load_avg_end']} (the machine is shared; "
        "the runs alternate in slices so that load slows every side alike)"
    )
    if args.png and not args.bpe:
        plot(res, args.png)
        print(f"wrote {args.png}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
