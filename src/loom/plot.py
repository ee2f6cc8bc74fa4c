"""`loom plot`: train and val loss against tokens seen, several runs overlaid (reads metrics.jsonl); with a
panel of validation bits per byte when the runs recorded it (comparable across tokenizers), one of the
capability scores when they recorded any (eval.tasks' accuracies, CORE: loom.eval.capability), one of
preference tuning's rewards, margin and accuracy (loom dpo), and two of loom rl's figures (reward, held-out
pass@k; answer length, entropy, clipping, KL) for RL runs. An RL run's training loss is its policy loss, a
surrogate near 0 whatever the model learns, so its validation loss (the chat data's cross-entropy) is drawn on
an axis of its own."""

from __future__ import annotations

import math
from pathlib import Path

from loom.errors import LoomError
from loom.metrics import read_jsonl


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backend_bases import FigureCanvasBase

    _check_out(out, FigureCanvasBase.get_supported_filetypes())
    runs = _read_runs(run_dirs)
    with_bpb = any("val_bpb" in r for _, recs in runs for r in recs)
    scores = sorted({k for _, recs in runs for r in recs for k in r if is_score(k)})
    mix = any("mix_tokens" in r for _, recs in runs for r in recs)
    ranks = any("stragglers" in r for _, recs in runs for r in recs)
    dpo = any("dpo/margin" in r for _, recs in runs for r in recs)
    rl = any("rl/reward_mean" in r for _, recs in runs for r in recs)
    n = 1 + with_bpb + bool(scores) + dpo + 2 * rl + 2 * mix + ranks
    fig, axes = plt.subplots(1, n, figsize=(8 if n == 1 else 6.5 * n, 5), squeeze=False)
    ax, ax_bpb = axes[0][0], axes[0][1] if with_bpb else None
    ax_score = axes[0][1 + with_bpb] if scores else None
    if mix:
        _plot_mix(runs, axes[0][-2 - ranks], axes[0][-1 - ranks])
    if ranks:
        _plot_ranks(runs, axes[0][-1])
    at = 1 + with_bpb + bool(scores)  # the stages' panels, after the loss, bpb and scores
    if dpo:
        _plot_dpo(runs, axes[0][at])
    if rl:
        _plot_rl(runs, axes[0][at + dpo], axes[0][at + dpo + 1])
    ax_sft = ax.twinx() if rl else None  # RL runs' val loss: another quantity than their policy loss
    for i, (rd, recs) in enumerate(runs):
        color = f"C{i % 10}"
        train = [(r["tokens"], r.get("loss_mean", r["loss"])) for r in recs if "loss" in r and "tokens" in r]
        val = [(r["tokens"], r["val_loss"]) for r in recs if "val_loss" in r]
        name = Path(rd).name
        is_rl = any("rl/reward_mean" in r for r in recs)
        if train:
            what = "policy loss" if is_rl else "train"
            ax.plot(*zip(*train, strict=True), color=color, alpha=0.6, label=f"{name} {what}")
            mark_quorum_changes(ax, recs, color)
        if val:
            on, what = (ax_sft, "val loss (chat data)") if is_rl else (ax, "val")
            on.plot(*zip(*val, strict=True), color=color, marker="o", linestyle="--", label=f"{name} {what}")
        bpb = [(r["tokens"], r["val_bpb"]) for r in recs if "val_bpb" in r]
        if bpb:
            ax_bpb.plot(*zip(*bpb, strict=True), color=color, marker="o", linestyle="--", label=name)
        for j, key in enumerate(scores):
            pts = [(r["tokens"], r[key]) for r in recs if key in r and "tokens" in r]
            if pts:
                style = ["-", "--", ":", "-."][j % 4]
                ax_score.plot(
                    *zip(*pts, strict=True),
                    color=color,
                    marker="o",
                    linestyle=style,
                    label=f"{name} {key.removeprefix('lm_eval/')}",
                )
    _label_axes(ax, ax_bpb, ax_score, ax_sft, rl)
    out = Path(out) if out else Path(run_dirs[0]) / "loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def mark_quorum_changes(ax, recs: list[dict], color: str) -> list[float]:
    """ft.enabled runs: a dotted line at each torchft quorum change after the first, labelled with the replica
    groups that left (-) and joined (+). Returns where the lines are (tokens)."""
    per_step = next((r["tokens"] / r["step"] for r in recs if "loss" in r and r.get("step")), None)
    changes = [r for r in recs if "ft" in r][1:]  # the first is the job's start
    if per_step is None or not changes:
        return []
    xs = []
    for r in changes:
        x, ft = r["step"] * per_step, r["ft"]
        ax.axvline(x, color=color, linestyle=":", alpha=0.7, gid="ft")
        what = " ".join([f"-g{k}" for k in ft["left"]] + [f"+g{k}" for k in ft["joined"]])
        ax.annotate(
            what or "quorum",
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            color=color,
            rotation=90,
            va="top",
            ha="right",
        )
        xs.append(x)
    return xs


def _check_out(out, kinds) -> None:
    """--out must name a file type matplotlib writes: one error before any run is read."""
    if out is not None and Path(out).suffix.lstrip(".").lower() not in kinds:
        raise LoomError(
            f"--out '{out}': matplotlib cannot write '{Path(out).suffix or 'no suffix'}' files",
            hint="name it .png (or " + ", ".join(f".{k}" for k in sorted(kinds) if k != "png") + ")",
        )


def _label_axes(ax, ax_bpb, ax_score, ax_sft, rl: bool) -> None:
    """Labels, grids and legends of the loss panel and, where drawn, the bpb and score panels and the RL runs'
    val-loss axis."""
    if ax_score is not None:
        ax_score.set_xlabel("tokens")
        ax_score.set_ylabel("accuracy (CORE: centred)")
        ax_score.grid(alpha=0.3)
        ax_score.legend(fontsize=7)
    if ax_bpb is not None:
        ax_bpb.set_xlabel("tokens")
        ax_bpb.set_ylabel("val bits per byte")
        ax_bpb.grid(alpha=0.3)
        ax_bpb.legend()
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (RL: policy loss)" if rl else "loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if ax_sft is not None:
        ax_sft.set_ylabel("RL runs: val loss on the chat data (cross-entropy)")
        if ax_sft.lines:
            ax_sft.legend(loc="upper right")


def _read_runs(run_dirs: list) -> list[tuple]:
    """(run directory, its metrics.jsonl records) of each run, or one error naming a folder without them."""
    runs = []
    for rd in run_dirs:
        path = Path(rd) / "metrics.jsonl"
        if not path.is_file():
            raise LoomError(f"'{rd}' has no metrics.jsonl", hint="give run directories written by loom train")
        runs.append((rd, read_jsonl(path)))
    return runs


def _plot_mix(runs: list, ax_val, ax_share) -> None:
    """data.mix runs: each source's validation loss, and the share of each logged interval's tokens it gave."""
    for i, (rd, recs) in enumerate(runs):
        name = Path(rd).name
        mixed = [r for r in recs if "mix_tokens" in r and "tokens" in r]
        sources = list(mixed[0]["mix_tokens"]) if mixed else []  # one colour per source in both panels
        for j, src in enumerate(sources):
            pts = [(r["tokens"], r[f"val_loss/{src}"]) for r in recs if f"val_loss/{src}" in r]
            if not pts:
                continue
            style = ["-", "--", ":", "-."][i % 4]
            ax_val.plot(
                *zip(*pts, strict=True),
                color=f"C{j % 10}",
                marker="o",
                linestyle=style,
                label=f"{name} {src}",
            )
        for j, src in enumerate(sources):
            ax_share.plot(*zip(*_shares(mixed, src), strict=True), color=f"C{j % 10}", label=f"{name} {src}")
    for a, label in ((ax_val, "val loss per source"), (ax_share, "share of each logged interval's tokens")):
        a.set_xlabel("tokens")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)


def _plot_ranks(runs: list, ax) -> None:
    """Multi-process runs (train.straggler_every): each window's step time per rank, the fastest to the slowest
    rank shaded around the median, and the windows that named a slow rank marked with its number."""
    import statistics

    for i, (rd, recs) in enumerate(runs):
        wins = [r for r in recs if "stragglers" in r]
        if not wins:
            continue
        steps = [r["step"] for r in wins]
        times = [[1000 * t for t in r["stragglers"]["step_s"]] for r in wins]
        color = f"C{i % 10}"
        ax.fill_between(steps, [min(t) for t in times], [max(t) for t in times], color=color, alpha=0.25)
        ax.plot(steps, [statistics.median(t) for t in times], color=color, label=f"{Path(rd).name} median")
        for step, r, t in zip(steps, wins, times, strict=True):
            slow = r["stragglers"]["slowest"]
            if slow:
                ax.annotate(
                    f"r{slow['rank']} {slow['phase']}", (step, t[slow["rank"]]), fontsize=7, color=color
                )
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step, per rank (min-max shaded)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_dpo(runs: list, ax) -> None:
    """Preference tuning (loom dpo): the chosen and rejected rewards, their margin, and on a second axis the
    share of pairs whose chosen reward is the larger."""
    acc = ax.twinx()
    for i, (rd, recs) in enumerate(runs):
        name, color = Path(rd).name, f"C{i % 10}"
        for key, style in (("chosen_reward", "-"), ("rejected_reward", ":"), ("margin", "--")):
            pts = [(r["tokens"], r[f"dpo/{key}"]) for r in recs if f"dpo/{key}" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=color, linestyle=style, label=f"{name} {key}")
        pts = [(r["tokens"], r["dpo/accuracy"]) for r in recs if "dpo/accuracy" in r]
        if pts:
            acc.plot(*zip(*pts, strict=True), color=color, alpha=0.3, label=f"{name} accuracy")
    ax.set_xlabel("tokens")
    ax.set_ylabel("reward: beta x log-ratio to the reference")
    acc.set_ylabel("accuracy (chosen reward > rejected)")
    acc.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    acc.legend(fontsize=7, loc="lower right")


def _plot_rl(runs: list, ax_reward, ax_detail) -> None:
    """loom rl runs: the reward's mean (its spread shaded) and held-out pass@1 / pass@k against the step; the
    answers' length, entropy, clipped fraction and KL against the step."""
    for i, (rd, recs) in enumerate(runs):
        name, color = Path(rd).name, f"C{i % 10}"
        pts = [
            (r["step"], r["rl/reward_mean"], r.get("rl/reward_std", 0.0))
            for r in recs
            if "rl/reward_mean" in r
        ]
        if pts:
            steps, mean, std = zip(*pts, strict=True)
            ax_reward.plot(steps, mean, color=color, label=f"{name} reward")
            low, high = _reward_range(
                recs
            )  # mean +- std clipped to what the rewards took: never below 0 for 0/1
            lo = [max(m - s, low) for m, s in zip(mean, std, strict=True)]
            hi = [min(m + s, high) for m, s in zip(mean, std, strict=True)]
            ax_reward.fill_between(steps, lo, hi, color=color, alpha=0.15)
        for j, key in enumerate(sorted({k for r in recs for k in r if k.startswith("rl/pass@")})):
            held = [(r["step"], r[key]) for r in recs if key in r]
            style = ["--", ":"][j % 2]
            ax_reward.plot(
                *zip(*held, strict=True), color=color, marker="o", linestyle=style, label=f"{name} {key[3:]}"
            )
        for j, key in enumerate(("rl/response_len", "rl/entropy", "rl/clip_frac", "rl/kl")):
            got = [(r["step"], r[key]) for r in recs if key in r]
            if got:
                style = ["-", "--", ":", "-."][j]
                ax_detail.plot(
                    *zip(*got, strict=True), color=color, linestyle=style, label=f"{name} {key[3:]}"
                )
    for a, label in (
        (ax_reward, "reward / held-out pass rate"),
        (ax_detail, "answer length, entropy, clip, KL"),
    ):
        a.set_xlabel("step")
        a.set_ylabel(label)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)


def _reward_range(recs: list[dict]) -> tuple[float, float]:
    """The range an RL run's rewards took (rl/reward_min, rl/reward_max of its rollouts); unbounded for a run
    recorded before they were."""
    lows = [r["rl/reward_min"] for r in recs if "rl/reward_min" in r]
    highs = [r["rl/reward_max"] for r in recs if "rl/reward_max" in r]
    return (min(lows) if lows else -math.inf, max(highs) if highs else math.inf)


def _shares(recs: list[dict], src: str) -> list[tuple[int, float]]:
    """(tokens, the share of the tokens since the record before that `src` gave): a schedule's switch shows
    at its step, where a share since the start would bend slowly."""
    out, prev = [], {k: 0 for k in recs[0]["mix_tokens"]}
    for r in recs:
        gained = {k: v - prev.get(k, 0) for k, v in r["mix_tokens"].items()}
        if sum(gained.values()) > 0:
            out.append((r["tokens"], gained[src] / sum(gained.values())))
        prev = r["mix_tokens"]
    return out


def is_score(key: str) -> bool:
    """A capability score of metrics.jsonl: an accuracy of a harness task, or CORE."""
    return key == "core" or (
        key.startswith("lm_eval/") and key.rsplit("/", 1)[-1] in ("acc", "acc_norm", "exact_match")
    )
