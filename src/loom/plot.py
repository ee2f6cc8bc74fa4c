"""`loom plot`: train and val loss against tokens seen, several runs overlaid (reads metrics.jsonl)."""

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
        raise LoomError(f"--out '{out}': matplotlib cannot write '{Path(out).suffix or 'no suffix'}' files",
                        hint="name it .png (or " + ", ".join(f".{k}" for k in sorted(kinds) if k != "png") + ")")  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, rd in enumerate(run_dirs):
        path = Path(rd) / "metrics.jsonl"
        if not path.is_file():
            raise LoomError(f"'{rd}' has no metrics.jsonl", hint="give run directories written by loom train")
        recs = read_jsonl(path)
        color = f"C{i % 10}"
        train = [(r["tokens"], r["loss"]) for r in recs if "loss" in r and "tokens" in r]
        val = [(r["tokens"], r["val_loss"]) for r in recs if "val_loss" in r]
        name = Path(rd).name
        if train:
            ax.plot(*zip(*train, strict=True), color=color, alpha=0.6, label=f"{name} train")
        if val:
            ax.plot(*zip(*val, strict=True), color=color, marker="o", linestyle="--", label=f"{name} val")
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
