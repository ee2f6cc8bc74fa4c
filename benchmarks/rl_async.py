"""Asynchronous rollouts (rl.max_staleness) against the synchronous loop on the README's RL recipe, in one run:
steps per hour and held-out pass@1 of each, and what a sampler device beside a trainer device would give.

    python benchmarks/rl_async.py --recipe /tmp/recipe --out benchmarks/results/cpu-2core-2026-12-02 --steps 400

--recipe: a folder holding the README recipe's arith/, chat/ and runs/sft (its step-600 checkpoint); made there
with the README's commands when missing. Every run is the README's `loom rl` command (32 prompts x 8 answers of
up to 4 tokens a step, exact reward, a constant 2e-4) in fp32, for --steps steps, held-out pass@1 (greedy, 200
sums) before the first step and after the last:
  - sync:  rl.max_staleness=0, torch on both cores (the loop samples, then trains, each with both cores);
  - K=1, K=2: the rollout worker on one core (rl.sampler_threads=1) beside the trainer on the other
    (OMP_NUM_THREADS=1 for the trainer): what overlap two CPU cores allow.
Steps per hour count the steps' own time (each step's `dt`: sampling, or the wait for the worker, plus training),
not the start or the held-out evaluations, which are the same work in every run.

The sampler-device estimate, from the synchronous run's split of a step (medians over its steps): R, the seconds
sampling (rl/rollout_s), and T = dt - R, the rest of the step (scoring, the forward and backward, the update). On
two devices (one samples, one trains) with K >= 1, a step takes max(R, T + P), P the weight push (the model's
bytes over the link between them; measured here as the trainer's cost of a push on a CPU, which is only its
copy), so the speed-up is (R + T) / max(R, T + P). It assumes each device runs its half as fast as the run
measured it with both cores; on GPUs the ratio R : T differs (sampling is memory-bound decode), so the formula,
not the number, is what carries over.
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

ROOT = Path(__file__).resolve().parents[1]
LOOM = str(Path(sys.executable).with_name("loom"))

RECIPE = [  # the README's commands up to the SFT run (the task, the base, the chat data, SFT)
    [sys.executable, str(ROOT / "scripts" / "make_arith.py"), "--out", "arith", "--digits", "2"]
    + ["--n-train", "3000", "--n-heldout", "200", "--n-sft", "600"],
    [LOOM, "data", "prepare", "--input", "arith/base.txt", "--out", "text", "--tokenizer", "char"],
    [LOOM, "train", "--data.path=text", "--run.name=base", "--model.n_layer=4", "--model.n_head=4"]
    + ["--model.n_embd=128", "--model.block_size=32", "--train.steps=300", "--train.batch_size=32"]
    + ["--optim.lr=1e-3", "--optim.warmup_steps=20"],
    [LOOM, "data", "prepare", "--chat", "--input", "arith/sft.jsonl", "--out", "chat", "--tokenizer"]
    + ["runs/base", "--block-size", "32"],
    [LOOM, "sft", "--data.path=chat", "--model.init_from=run:runs/base", "--run.name=sft"]
    + ["--train.steps=1200", "--train.batch_size=32", "--optim.lr=1e-3", "--optim.warmup_steps=10"]
    + ["--train.ckpt_every=600"],
]


def rl_command(recipe: Path, runs: Path, name: str, steps: int, *extra: str) -> list[str]:
    """The README's `loom rl` command (fp32, held-out pass@1 at the start and the end only)."""
    return [
        LOOM,
        "rl",
        f"--data.path={recipe / 'chat'}",
        f"--model.init_from=run:{recipe / 'runs' / 'sft' / 'ckpt' / 'step_000600'}",
        f"--run.dir={runs}",
        f"--run.name={name}",
        f"--rl.prompts={recipe / 'arith' / 'rl_train.jsonl'}",
        f"--rl.eval_prompts={recipe / 'arith' / 'rl_heldout.jsonl'}",
        "--rl.eval_k=0",
        "--rl.group_size=8",
        "--train.batch_size=256",
        "--rl.max_new_tokens=4",
        "--rl.reward=exact",
        f"--train.steps={steps}",
        "--optim.lr=2e-4",
        "--optim.min_lr=2e-4",
        "--optim.warmup_steps=10",
        "--precision.dtype=fp32",
        "--train.log_every=1",
        "--train.ckpt_every=0",
        *extra,
    ]


def ensure_recipe(recipe: Path) -> None:
    if (recipe / "runs" / "sft" / "ckpt" / "step_000600").exists():
        return
    recipe.mkdir(parents=True, exist_ok=True)
    for cmd in RECIPE:
        subprocess.run(cmd, cwd=recipe, check=True)


def summarise(run: Path, wall: float) -> dict:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [r for r in recs if "loss" in r and "step" in r]
    evals = [r for r in recs if "rl/pass@1" in r]
    dts = [r["dt"] for r in steps]
    out = {
        "steps": len(steps),
        "wall_s": round(wall, 1),
        "steps_s": round(sum(dts), 2),
        "steps_per_hour": round(3600 * len(steps) / sum(dts)),
        "median_step_s": statistics.median(dts),
        "median_rollout_s": statistics.median(r["rl/rollout_s"] for r in steps),
        "pass@1_start": evals[0]["rl/pass@1"],
        "pass@1_end": evals[-1]["rl/pass@1"],
        "reward_last50": statistics.fmean(r["rl/reward_mean"] for r in steps[-50:]),
    }
    if "rl/staleness" in steps[-1]:
        out["staleness_max"] = max(r["rl/staleness"] for r in steps)
        out["median_wait_s"] = statistics.median(r["rl/rollout_wait_s"] for r in steps)
        out["is_weight_mean"] = statistics.fmean(r["rl/is_weight_mean"] for r in steps)
        out["is_weight_max"] = max(r["rl/is_weight_max"] for r in steps)
        out["is_truncated_frac_mean"] = statistics.fmean(r["rl/is_truncated_frac"] for r in steps)
        out["logprob_diff_max"] = max(r["rl/logprob_diff"] for r in steps)
    return out


def push_cost(recipe: Path) -> dict:
    """The trainer's cost of one weight push of the recipe's model (its copy into a flat buffer; the send itself
    does not wait), and its bytes."""
    import torch

    from loom.rl.weight_sync import layout, live_state
    from loom.runs import load_run

    here = os.getcwd()
    os.chdir(recipe)  # the run's config names its base relative to the recipe's folder
    try:
        _, model, *_ = load_run(Path("runs") / "sft", torch.device("cpu"))
    finally:
        os.chdir(here)
    state = live_state(model, {})
    rows = layout(state)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.cat([state[n].detach().reshape(-1) for n, *_ in rows])
    secs = (time.perf_counter() - t0) / 20
    return {"bytes": sum(t.numel() * t.element_size() for t in state.values()), "copy_s": secs}


def estimate(sync: dict, push: dict, link_gb_s: float) -> dict:
    """max(R, T + P) for a sampler device beside a trainer device (the module's docstring)."""
    step, R = sync["median_step_s"], sync["median_rollout_s"]
    T = step - R
    P = push["bytes"] / (link_gb_s * 1e9)
    two = max(R, T + P)
    return {
        "R_s": R,
        "T_s": T,
        "P_s": P,
        "link_GB_s": link_gb_s,
        "step_s": two,
        "speedup": step / two,
        "formula": "(R + T) / max(R, T + P)",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument(
        "--runs", type=Path, default=Path("/tmp/rl_async_runs"), help="the runs' folders (not kept)"
    )
    ap.add_argument("--ks", default="1,2", help="the rl.max_staleness values run beside the synchronous one")
    ap.add_argument(
        "--link-gb-s", type=float, default=25.0, help="the sampler-trainer link (PCIe 4 x16: ~25)"
    )
    a = ap.parse_args(argv)
    a.recipe = a.recipe.resolve()
    ensure_recipe(a.recipe)
    runs = a.runs.resolve()
    runs.mkdir(parents=True, exist_ok=True)
    plan = [("sync", "2", [])]
    for K in (int(k) for k in a.ks.split(",") if k):
        plan.append((f"K={K}", "1", [f"--rl.max_staleness={K}", "--rl.sampler_threads=1"]))
    results = {}
    for label, threads, extra in plan:
        name = "rl-async-" + label.replace("=", "")
        cmd = rl_command(a.recipe, runs, name, a.steps, "--force", *extra)
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=a.recipe)
        results[label] = summarise(runs / name, time.perf_counter() - t0)
        print(label, json.dumps(results[label]), flush=True)
    push = push_cost(a.recipe)
    report = {
        "command": " ".join(sys.argv),
        "steps": a.steps,
        "runs": results,
        "push": push,
        "two_devices": estimate(results["sync"], push, a.link_gb_s),
    }
    (a.out / "rl_async.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["two_devices"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
