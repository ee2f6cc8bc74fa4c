"""RL with a calculator tool against RL without it, on a task that needs one (issue 60): products of a 3-digit
and a 2-digit number, held-out pass@1 through training, on this CPU.

    python benchmarks/rl_tools.py --out benchmarks/results/cpu-2core-2026-12-02 [--work /tmp/rl_tools]

1. task (scripts/make_calc.py): 3,000 train and 200 held-out problems "123*45=" (disjoint), 400 SFT
   conversations each way: with the tool through the chat template's tool role (assistant "<calc>123*45</calc>",
   tool "<result>5535</result>", assistant "5535"; SFT trains on the assistant's turns, the tool's result masked),
   and answered directly (assistant "5535").
2. base: one char-level run on the task's text (the products as lines and as calculator transcripts).
3. SFT, twice from that base, the same problems, steps and rate: on the tool conversations, and on the direct
   answers. A model must learn the call format before RL can reward it: this is what people do (a small SFT on
   episodes that use the tool, then RL).
4. RL, twice, the same steps, prompts, group size and rate: with the tool (rl.env=loom.rl.envs:Calculator, up to
   3 turns: a call, the result, the answer) from the tool SFT run, and without it (one answer, rl.reward=numeric)
   from the direct SFT run. Held-out pass@1 (greedy, the first --heldout problems) every --eval-every steps.
Writes rl_tools.json (every run's command and the two pass@1 curves) and rl_tools.png into --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--model.n_layer=4", "--model.n_head=4", "--model.n_embd=128", "--model.block_size=96"]
QUIET = ["--train.eval_every=0", "--train.sample_every=0", "--train.eval_batches=2", "--train.device=cpu"]
FP32 = ["--precision.dtype=fp32"]  # batch-invariance is exact in fp32: rl/logprob_diff 0


def loom(*args: str) -> None:
    from loom.cli import main

    t0 = time.perf_counter()
    rc = main(list(args))
    print(f"[rl_tools] {args[0]} done in {time.perf_counter() - t0:.0f}s (exit {rc})", flush=True)
    if rc != 0:
        raise SystemExit(f"loom {' '.join(args)} failed with exit {rc}")


def make_task(work: Path, a: argparse.Namespace) -> Path:
    spec = importlib.util.spec_from_file_location("make_calc", ROOT / "scripts" / "make_calc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    task = work / "calc"
    argv = ["--out", str(task), "--n-train", str(a.n_train), "--n-heldout", "200", "--n-sft", str(a.n_sft)]
    assert mod.main(argv) == 0
    return task


def curve(run: Path) -> list[tuple[int, float]]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "rl/pass@1" in r:
            out.append((r["step"], r["rl/pass@1"]))
    return sorted(dict(out).items())


def last_figures(run: Path) -> dict:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "rl/reward_mean" in r]
    keys = ("rl/reward_mean", "rl/turns", "rl/env_dropped", "rl/tool_errors", "rl/logprob_diff")
    return {
        "max_logprob_diff": max(r.get("rl/logprob_diff", 0.0) for r in steps),
        "env_dropped": sum(r.get("rl/env_dropped", 0) for r in steps),
        "tool_errors": sum(r.get("rl/tool_errors", 0) for r in steps),
        "last": {k: steps[-1][k] for k in keys if k in steps[-1]},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu-2core-2026-12-02"))
    p.add_argument("--work", default="/tmp/rl_tools")
    p.add_argument("--n-train", type=int, default=3000)
    p.add_argument("--n-sft", type=int, default=400)
    p.add_argument("--base-steps", type=int, default=300)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--rl-steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--heldout", type=int, default=200, help="held-out problems scored")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=1e-4)
    p.add_argument("--only", choices=("setup", "tool", "plain", "all"), default="all")
    a = p.parse_args()
    work, out = Path(a.work), Path(a.out)
    runs = work / "runs"
    task = work / "calc"
    commands: dict[str, list[str]] = {}
    if a.only in ("setup", "all"):
        task = make_task(work, a)
        prep = ["data", "prepare", "--input", str(task / "base.txt"), "--out", str(work / "text")]
        loom(*prep, "--tokenizer", "char")
        base = [f"--data.path={work / 'text'}", f"--run.dir={runs}", "--run.name=base", *MODEL, *QUIET, *FP32]
        commands["base"] = ["train", *base, f"--train.steps={a.base_steps}", "--train.batch_size=32"]
        loom(*commands["base"])
        for kind in ("tool", "plain"):
            chat = ["data", "prepare", "--chat", "--input", str(task / f"sft_{kind}.jsonl")]
            loom(
                *chat,
                "--out",
                str(work / f"chat_{kind}"),
                "--tokenizer",
                str(runs / "base"),
                "--block-size",
                "96",
            )
            commands[f"sft_{kind}"] = [
                "sft",
                f"--data.path={work / f'chat_{kind}'}",
                f"--model.init_from=run:{runs / 'base'}",
                f"--run.dir={runs}",
                f"--run.name=sft_{kind}",
                f"--train.steps={a.sft_steps}",
                "--train.batch_size=16",
                "--optim.lr=1e-3",
                *QUIET,
                *FP32,
            ]
            loom(*commands[f"sft_{kind}"])
    rl_common = [
        f"--run.dir={runs}",
        f"--rl.prompts={task / 'rl_train.jsonl'}",
        f"--rl.eval_prompts={task / 'rl_heldout.jsonl'}",
        f"--rl.eval_limit={a.heldout}",
        f"--rl.eval_every={a.eval_every}",
        "--rl.eval_k=0",
        f"--rl.group_size={a.group}",
        f"--train.batch_size={a.prompts_per_step * a.group}",
        f"--train.steps={a.rl_steps}",
        f"--optim.lr={a.rl_lr}",
        f"--optim.min_lr={a.rl_lr}",
        "--optim.warmup_steps=5",
        "--rl.max_dropped_steps=0",  # without the tool every reward may be 0 for long stretches
        "--train.ckpt_every=0",
        *QUIET,
        *FP32,
    ]
    timing = {}
    for kind in ("tool", "plain"):
        if a.only not in (kind, "all"):
            continue
        own = (
            ["--rl.env=loom.rl.envs:Calculator", "--rl.max_turns=3", "--rl.max_new_tokens=24"]
            if kind == "tool"
            else ["--rl.reward=numeric", "--rl.max_new_tokens=8"]
        )
        commands[f"rl_{kind}"] = [
            "rl",
            f"--data.path={work / f'chat_{kind}'}",
            f"--model.init_from=run:{runs / f'sft_{kind}'}",
            f"--run.name=rl_{kind}",
            *rl_common,
            *own,
        ]
        t0 = time.perf_counter()
        loom(*commands[f"rl_{kind}"])
        timing[kind] = time.perf_counter() - t0
    if a.only != "all":
        return 0
    result = {
        "task": "a*b, a 3-digit, b 2-digit; 200 held-out problems (disjoint from train)",
        "pass@1": {k: curve(runs / f"rl_{k}") for k in ("tool", "plain")},
        "rl_seconds": timing,
        "figures": {k: last_figures(runs / f"rl_{k}") for k in ("tool", "plain")},
        "commands": {k: "loom " + " ".join(v) for k, v in commands.items()},
        "settings": vars(a),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl_tools.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "rl_tools.png")
    print(json.dumps({k: result[k] for k in ("pass@1", "rl_seconds")}, indent=1))
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, label in (("tool", "RL with the calculator (rl.env)"), ("plain", "RL without a tool")):
        pts = result["pass@1"][kind]
        ax.plot([s for s, _ in pts], [100 * v for _, v in pts], marker="o", label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out pass@1 (%)")
    ax.set_title("3-digit x 2-digit products, 200 held-out problems")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
