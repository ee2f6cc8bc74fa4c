"""Held-out curves of several `loom rl` runs (the README's base-model recipe on three seeds): each run's held-out
pass@1 (greedy) and pass@k by step and by wall time, from its metrics.jsonl, into one JSON and one figure.

    python benchmarks/rl_zero_curves.py runs/rl-zero-s0 runs/rl-zero-s1 runs/rl-zero-s2 --out rl_zero

Writes OUT.json ({run: {step, pass@1, pass@k, elapsed_s}}) and OUT.png (pass@1 solid, pass@k dashed, by minute).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curve(run: Path) -> dict:
    """The run's held-out evaluations in step order, each with the wall time (s) the training had taken by then
    (the newest training record at or before that step; 0 for the baseline)."""
    recs = [json.loads(x) for x in open(run / "metrics.jsonl")]
    elapsed = {r["step"]: r["elapsed_s"] for r in recs if "elapsed_s" in r}
    evals = sorted(
        {r["step"]: r for r in recs if "rl/pass@1" in r}.values(), key=lambda r: r["step"]
    )  # one per step: a resumed run's repeat keeps the last
    if not evals:
        raise SystemExit(f"{run}: no held-out evaluation in metrics.jsonl (rl.eval_prompts unset?)")
    k = next(key for key in evals[0] if key.startswith("rl/pass@") and key != "rl/pass@1")
    out: dict = {"step": [], "pass@1": [], k[3:]: [], "elapsed_s": []}
    for r in evals:
        done = [s for s in elapsed if s <= r["step"]]
        out["step"].append(r["step"])
        out["pass@1"].append(r["rl/pass@1"])
        out[k[3:]].append(r[k])
        out["elapsed_s"].append(elapsed[max(done)] if done else 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", required=True, help="OUT.json and OUT.png")
    p.add_argument(
        "--title", default="loom rl from a base model: held-out pass@1 (solid) and pass@k (dashed)"
    )
    a = p.parse_args(argv)
    curves = {r.name: curve(r) for r in a.runs}
    Path(a.out + ".json").write_text(json.dumps(curves, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, c) in enumerate(curves.items()):
        k = next(key for key in c if key.startswith("pass@") and key != "pass@1")
        minutes = [s / 60 for s in c["elapsed_s"]]
        ax.plot(minutes, [100 * v for v in c["pass@1"]], "-o", color=f"C{i}", label=f"{name} pass@1")
        ax.plot(minutes, [100 * v for v in c[k]], "--", color=f"C{i}", alpha=0.6, label=f"{name} {k}")
    ax.set_xlabel("wall time (minutes)")
    ax.set_ylabel("held-out %")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(a.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=120)
    print(f"wrote {a.out}.json and {a.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
