"""μP's two checks (model.mup, loom.model.mup), on loom's GPT and loom's optimizer groups, on this CPU.

coord: the coordinate check of Tensor Programs V (Fig. 5) and the practitioner's guide: the RMS of each layer's
output (the embedding, each block's attention and MLP outputs, the logits) after t = 0, 1, ... steps of AdamW,
for widths 64 -> 1024 (n_head fixed, so the heads widen), under the standard parametrisation and under μP with
base width 64. Under μP the curves are flat in width; under SP the hidden and output activations grow with it
once training moves the weights.

sweep: a 7-point learning-rate sweep (lr = base * 2^k, k = -3..3) at width 64 and a wider width, SP and μP,
short runs from the same seed on the same batches; the final training loss (mean of the last 10 steps) per
rate. Under μP the best rate should stay where width 64 put it; under SP it moves down as the width grows.

The data: the interpreter's standard library as bytes (vocabulary 256), windows drawn from a fixed generator.

    python benchmarks/mup_coord.py coord --out benchmarks/results/cpu-2core-2026-12-02
    python benchmarks/mup_coord.py sweep --widths 64,512 --steps 150 --out benchmarks/results/cpu-2core-2026-12-02
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from loom.config import OptimConfig
from loom.data.corpus import python_stdlib_files
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.optim.build import build_optimizer

BASE = 64


def corpus(n_bytes: int = 4_000_000) -> torch.Tensor:
    out, size = [], 0
    for f in python_stdlib_files():
        b = f.read_bytes()
        out.append(b)
        size += len(b)
        if size >= n_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:n_bytes]), dtype=torch.uint8).long()


def batches(data: torch.Tensor, n: int, batch: int, block: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ix = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + block + 1] for i in ix])
        yield x, y


def model_of(width: int, mup: bool, seed: int, n_layer: int = 2, n_head: int = 4, block: int = 64) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=256, n_layer=n_layer, n_head=n_head, n_embd=width, block_size=block)
    cfg.mup_base_width = BASE if mup else 0
    return GPT(cfg)


def optimizer(model: GPT, lr: float):
    opt = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0), torch.device("cpu"))
    for g in opt.param_groups:  # what the trainer's schedule does (constant here)
        g["lr"] = lr * g.get("lr_mult", 1.0)
    return opt


def layer_rms(model: GPT, x: torch.Tensor) -> dict[str, float]:
    """RMS of each layer's output on the batch x (forward hooks)."""
    found: dict[str, float] = {}
    hooks = []

    def keep(name):
        return lambda mod, inp, out: found.__setitem__(name, out.detach().float().pow(2).mean().sqrt().item())

    hooks.append(model.wte.register_forward_hook(keep("embedding")))
    for i, b in enumerate(model.blocks):
        hooks.append(b.attn.register_forward_hook(keep(f"attn {i}")))
        hooks.append(b.mlp.register_forward_hook(keep(f"mlp {i}")))
    hooks.append(model.lm_head.register_forward_hook(keep("logits")))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return found


def coord(args) -> dict:
    data = corpus()
    widths = [int(w) for w in args.widths.split(",")]
    out: dict = {"widths": widths, "steps": args.steps, "lr": args.lr, "seeds": args.seeds, "runs": {}}
    for mup in (False, True):
        for w in widths:
            per_step: dict[int, dict[str, float]] = {}
            for seed in range(args.seeds):
                model = model_of(w, mup, seed)
                opt = optimizer(model, args.lr)
                probe = next(batches(data, 1, 16, 64, 1000 + seed))[0]
                for t, (x, y) in enumerate(batches(data, args.steps + 1, 16, 64, seed)):
                    rms = layer_rms(model, probe)
                    for k, v in rms.items():
                        per_step.setdefault(t, {}).setdefault(k, 0.0)
                        per_step[t][k] += v / args.seeds
                    if t == args.steps:
                        break
                    model(x, y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            out["runs"][f"{'mup' if mup else 'sp'} {w}"] = per_step
            print(
                f"{'muP' if mup else 'SP '} width {w}: step {args.steps} {per_step[args.steps]}", flush=True
            )
    return out


def plot_coord(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(res["runs"][f"sp {res['widths'][0]}"][0])
    steps = sorted(res["runs"][f"sp {res['widths'][0]}"])
    fig, axes = plt.subplots(2, len(layers), figsize=(3 * len(layers), 6), sharex=True)
    for row, kind in enumerate(("sp", "mup")):
        for col, layer in enumerate(layers):
            ax = axes[row][col]
            for t in steps:
                ys = [res["runs"][f"{kind} {w}"][t][layer] for w in res["widths"]]
                ax.plot(res["widths"], ys, marker="o", label=f"t={t}", color=plt.cm.viridis(t / max(steps)))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{'μP' if kind == 'mup' else 'SP'}: {layer}", fontsize=9)
            if row == 1:
                ax.set_xlabel("width (n_embd)")
            if col == 0:
                ax.set_ylabel("activation RMS")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"coordinate check: AdamW lr {res['lr']}, {res['seeds']} seeds, μP base width {BASE}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def sweep(args) -> dict:
    data = corpus()
    widths = [int(w) for w in args.widths.split(",")]
    lrs = [args.lr * 2.0**k for k in range(-3, 4)]
    out: dict = {"widths": widths, "lrs": lrs, "steps": args.steps, "loss": {}}
    for mup in (False, True):
        for w in widths:
            for lr in lrs:
                t0 = time.perf_counter()
                model = model_of(w, mup, 0)
                opt = optimizer(model, lr)
                losses = []
                for x, y in batches(data, args.steps, 16, 64, 0):
                    loss = model(x, y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(loss.item())
                final = sum(losses[-10:]) / 10
                final = final if math.isfinite(final) else float("nan")
                out["loss"][f"{'mup' if mup else 'sp'} {w} {lr}"] = final
                dt = time.perf_counter() - t0
                print(
                    f"{'muP' if mup else 'SP '} width {w} lr {lr:.2e}: loss {final:.4f} ({dt:.0f}s)",
                    flush=True,
                )
    return out


def plot_sweep(res: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind in zip(axes, ("sp", "mup"), strict=True):
        for w in res["widths"]:
            ys = [res["loss"][f"{kind} {w} {lr}"] for lr in res["lrs"]]
            ax.plot(res["lrs"], ys, marker="o", label=f"width {w}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("AdamW learning rate (base)")
        ax.set_title("μP (base width 64)" if kind == "mup" else "SP")
        ax.legend()
    axes[0].set_ylabel(f"train loss, mean of the last 10 of {res['steps']} steps")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def best(res: dict) -> dict:
    """The best rate per (parametrisation, width), and how far it moved from the narrowest width's."""
    out = {}
    for kind in ("sp", "mup"):
        rates = {}
        for w in res["widths"]:
            losses = {lr: res["loss"][f"{kind} {w} {lr}"] for lr in res["lrs"]}
            rates[w] = min((v, lr) for lr, v in losses.items() if math.isfinite(v))[1]
        first = rates[res["widths"][0]]
        out[kind] = {
            str(w): {"best_lr": lr, "moved_x": max(lr, first) / min(lr, first)} for w, lr in rates.items()
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("coord", "sweep"))
    p.add_argument("--widths", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="coord: the rate; sweep: the middle of the 7")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/cpu-2core-2026-12-02")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "coord":
        args.widths, args.steps = args.widths or "64,128,256,512,1024", args.steps or 4
        args.lr = args.lr or 1e-2
        res = coord(args)
        (out / "mup_coord.json").write_text(json.dumps(res, indent=1))
        plot_coord(res, out / "mup_coord.png")
    else:
        args.widths, args.steps, args.lr = args.widths or "64,512", args.steps or 150, args.lr or 4e-3
        res = sweep(args)
        res["best"] = best(res)
        (out / "mup_lr_sweep.json").write_text(json.dumps(res, indent=1))
        plot_sweep(res, out / "mup_lr_sweep.png")
        print(json.dumps(res["best"], indent=1))


if __name__ == "__main__":
    main()
