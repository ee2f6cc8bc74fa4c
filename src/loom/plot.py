"""`loom plot`: train and val loss against tokens seen, several runs overlaid (reads metrics.jsonl); with a
second panel of validation bits per byte when the runs recorded it (comparable across tokenizers)."""

from __future__ import annotations

from pathlib import Path

from loom.errors import LoomError
from loom.metrics import read_jsonl


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if out is not None and Path(out).suffix.lstrip(".").lower() not in kinds:
        raise LoomError(
            f"--out '{out}': matplotlib cannot write '{Path(out).suffix or 'no suffix'}' files",
            hint="name it .png (or " + ", ".join(f".{k}" for k in sorted(kinds) if k != "png") + ")",
        )
    runs = []
    for rd in run_dirs:
        path = Path(rd) / "metrics.jsonl"
        if not path.is_file():
            raise LoomError(f"'{rd}' has no metrics.jsonl", hint="give run directories written by loom train")
        runs.append((rd, read_jsonl(path)))
    with_bpb = any("val_bpb" in r for _, recs in runs for r in recs)
    if with_bpb:
        fig, (ax, ax_bpb) = plt.subplots(1, 2, figsize=(13, 5))
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
    for i, (rd, recs) in enumerate(runs):
        color = f"C{i % 10}"
        train = [(r["tokens"], r["loss"]) for r in recs if "loss" in r and "tokens" in r]
        val = [(r["tokens"], r["val_loss"]) for r in recs if "val_loss" in r]
        name = Path(rd).name
        if train:
            ax.plot(*zip(*train, strict=True), color=color, alpha=0.6, label=f"{name} train")
        if val:
            ax.plot(*zip(*val, strict=True), color=color, marker="o", linestyle="--", label=f"{name} val")
        bpb = [(r["tokens"], r["val_bpb"]) for r in recs if "val_bpb" in r]
        if bpb:
            ax_bpb.plot(*zip(*bpb, strict=True), color=color, marker="o", linestyle="--", label=name)
    if with_bpb:
        ax_bpb.set_xlabel("tokens")
        ax_bpb.set_ylabel("val bits per byte")
        ax_bpb.grid(alpha=0.3)
        ax_bpb.legend()
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out) if out else Path(run_dirs[0]) / "loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
