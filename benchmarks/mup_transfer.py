"""μP's learning-rate transfer (issue 61): a 7-point AdamW learning-rate sweep at width 64 and at width 512,
under the standard parametrisation (SP) and under μP (model.mup, base width 64), scored by held-out loss.

The claim under test (Tensor Programs V, Fig. 1): under μP the best learning rate found at the base width is
the best at the wide one too; under SP it moves (down) as the width grows.

What every run shares: loom's GPT (n_layer 2, n_head 4 at every width, so the heads widen; block 64; byte
vocabulary 256, tied head), loom's own optimizer groups (loom.optim.build: the per-group "lr_mult" μP gives,
applied as the trainer's schedule does), AdamW without weight decay and without gradient clipping (a global
clip would rescale μP's groups together and is not part of μP), loom's warmup-stable-decay schedule
(loom.optim.schedule.lr_at: 10 % linear warm-up, hold, linear decay to 0 over the last 30 %), batch 16 x 64
tokens, the same batches for every run of a seed (the interpreter's standard library as bytes, first 90 %),
one thread. The score: the mean loss over 16 fixed held-out batches of the last 10 % of the bytes, after the
last step. At width 64 μP and SP are the same model (tests/unit/test_mup.py), so width 64's runs count for both.

Each run is one line of OUT/mup_transfer_runs.jsonl, keyed by its settings; a run already there is skipped,
so an interrupted grid continues where it stopped. The first run of each (parametrisation, width) also logs
the learning-rate multiplier of every optimizer group and the parameters in it (the μP table as applied).

    python benchmarks/mup_transfer.py run --out benchmarks/results/cpu-2core-2026-12-02
    python benchmarks/mup_transfer.py report --out benchmarks/results/cpu-2core-2026-12-02
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from mup_coord import batches, corpus, model_of

from loom.config import OptimConfig
from loom.optim.build import build_optimizer
from loom.optim.schedule import lr_at

BATCH, BLOCK, VAL_BATCHES = 16, 64, 16
RUNS = "mup_transfer_runs.jsonl"


def split() -> tuple[torch.Tensor, torch.Tensor]:
    data = corpus()
    cut = len(data) * 9 // 10
    return data[:cut], data[cut:]


def group_table(model, opt) -> list[dict]:
    """Each optimizer group's learning-rate multiplier and the parameters it holds (by name)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        {
            "lr_mult": g.get("lr_mult", 1.0),
            "weight_decay": g["weight_decay"],
            "params": sorted(names[id(p)] for p in g["params"]),
        }
        for g in opt.param_groups
    ]


@torch.no_grad()
def val_loss(model, val: torch.Tensor) -> float:
    model.eval()
    losses = [model(x, y).item() for x, y in batches(val, VAL_BATCHES, BATCH, BLOCK, 12345)]
    model.train()
    return sum(losses) / len(losses)


def train_one(train: torch.Tensor, val: torch.Tensor, key: dict, log_groups: bool) -> dict:
    """One run of the grid: `key` holds kind ('sp' | 'mup'), width, lr, seed, steps."""
    t0 = time.perf_counter()
    model = model_of(key["width"], key["kind"] == "mup", key["seed"], block=BLOCK)
    opt = build_optimizer(model, OptimConfig(lr=key["lr"], weight_decay=0.0), torch.device("cpu"))
    steps = key["steps"]
    warmup = max(1, steps // 10)
    losses = []
    for step, (x, y) in enumerate(batches(train, steps, BATCH, BLOCK, key["seed"])):
        lr = lr_at(step, key["lr"], 0.0, warmup, steps, kind="wsd", decay_frac=0.3)
        for g in opt.param_groups:  # the trainer's rule (loom.train.trainer): lr * the group's μP multiplier
            g["lr"] = lr * g.get("lr_mult", 1.0)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    out = dict(key)
    out["train_loss"] = sum(losses[-10:]) / len(losses[-10:])
    out["val_loss"] = val_loss(model, val) if math.isfinite(out["train_loss"]) else float("nan")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if log_groups:
        out["groups"] = group_table(model, opt)
    return out


def key_of(r: dict) -> tuple:
    return (r["kind"], r["width"], round(math.log2(r["lr"]), 6), r["seed"], r["steps"])


def load(out: Path) -> list[dict]:
    path = out / RUNS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def grid(args) -> list[dict]:
    """The runs in the order they are made: seed by seed, so that a cut-short grid has whole sweeps."""
    lrs = [args.lr * 2.0**k for k in range(-3, 4)]
    widths = [int(w) for w in args.widths.split(",")]
    return [
        {"kind": kind, "width": w, "lr": lr, "seed": seed, "steps": args.steps}
        for seed in range(args.seeds)
        for w in widths
        for kind in ("sp", "mup")
        for lr in lrs
    ]


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = {key_of(r) for r in load(out)}
    logged = {(r["kind"], r["width"]) for r in load(out) if "groups" in r}
    train, val = split()
    for key in grid(args):
        if key_of(key) in done:
            continue
        r = train_one(train, val, key, (key["kind"], key["width"]) not in logged)
        logged.add((key["kind"], key["width"]))
        with (out / RUNS).open("a") as f:
            f.write(json.dumps(r) + "\n")
        print(
            f"{key['kind']:>3} width {key['width']:4d} lr {key['lr']:.2e} seed {key['seed']}: val "
            f"{r['val_loss']:.4f} train {r['train_loss']:.4f} ({r['seconds']:.0f}s)",
            flush=True,
        )


def table(runs: list[dict], steps: int) -> dict:
    """{kind: {width: {lr: [val losses over seeds]}}} of the runs with `steps` steps."""
    out: dict = {}
    for r in runs:
        if r["steps"] == steps:
            v = r["val_loss"] if math.isfinite(r["val_loss"]) else float("inf")
            out.setdefault(r["kind"], {}).setdefault(r["width"], {}).setdefault(r["lr"], []).append(v)
    return out


def best(tab: dict) -> dict:
    """The best rate (lowest mean val loss over seeds) per (kind, width), and its ratio to the narrowest's."""
    out = {}
    for kind, by_width in tab.items():
        rates = {
            w: min(by_lr, key=lambda lr: sum(by_lr[lr]) / len(by_lr[lr])) for w, by_lr in by_width.items()
        }
        first = rates[min(rates)]
        out[kind] = {
            str(w): {"best_lr": lr, "moved_x": max(lr, first) / min(lr, first), "direction": _dir(lr, first)}
            for w, lr in sorted(rates.items())
        }
    return out


def _dir(lr: float, first: float) -> str:
    return "same" if lr == first else ("up" if lr > first else "down")


def plot(tab: dict, steps: int, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind in zip(axes, ("sp", "mup"), strict=True):
        for w, by_lr in sorted(tab.get(kind, {}).items()):
            lrs = sorted(by_lr)
            mean = [sum(by_lr[lr]) / len(by_lr[lr]) for lr in lrs]
            ax.plot([math.log2(lr) for lr in lrs], mean, marker="o", label=f"width {w}")
            for lr in lrs:  # each seed's point, faint
                ax.scatter([math.log2(lr)] * len(by_lr[lr]), by_lr[lr], s=8, alpha=0.3, color="gray")
            i = min(range(len(lrs)), key=lambda j: mean[j])
            ax.scatter([math.log2(lrs[i])], [mean[i]], s=120, marker="*", color=ax.lines[-1].get_color())
        ax.set_xlabel("log2 AdamW learning rate (base: the embedding's and head's)")
        ax.set_title("μP (base width 64)" if kind == "mup" else "SP (standard parametrisation)")
        ax.legend()
    axes[0].set_ylabel(f"held-out loss after {steps} steps (mean over seeds)")
    finite = [
        v for k in tab.values() for w in k.values() for vs in w.values() for v in vs if math.isfinite(v)
    ]
    if finite:
        axes[0].set_ylim(min(finite) - 0.05, max(finite) + 0.05)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def report(args) -> None:
    out = Path(args.out)
    runs = load(out)
    tab = table(runs, args.steps)
    res = {"steps": args.steps, "batch": [BATCH, BLOCK], "val_loss": tab, "best": best(tab)}
    res["groups"] = {f"{r['kind']} {r['width']}": r["groups"] for r in runs if "groups" in r}
    (out / "mup_transfer.json").write_text(json.dumps(res, indent=1))
    plot(tab, args.steps, out / "mup_transfer.png")
    for kind, by_width in sorted(tab.items()):
        for w, by_lr in sorted(by_width.items()):
            cells = "  ".join(
                f"{lr:.1e}:{sum(v) / len(v):.4f}(n={len(v)})" for lr, v in sorted(by_lr.items())
            )
            print(f"{kind:>3} {w:4d}  {cells}")
    print(json.dumps(res["best"], indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("run", "report"))
    p.add_argument("--widths", default="64,512")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3, help="the middle of the 7 rates (x2 apart)")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/cpu-2core-2026-12-02")
    args = p.parse_args()
    torch.set_num_threads(1)
    run(args) if args.what == "run" else report(args)


if __name__ == "__main__":
    main()
