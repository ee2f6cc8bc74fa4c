"""`loom verify`: the proof that N processes with the same global batch learn the same curve as one.

The same small model is trained on the same data by one process (the reference) and by every requested
strategy; the loss curves and final parameters are compared. The reference runs with micro-batch
batch_size / 4 (4 accumulation steps) and the strategies with the same micro-batch, so dp=2 runs 2
accumulation steps and dp=4 one: a pass also shows gradient-accumulation invariance.

A strategy is one entry in STRATEGIES: a name, how it picks its world size, and the command that runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loom import log
from loom.errors import LoomError
from loom.metrics import read_jsonl

PY = [sys.executable, "-m", "loom", "train"]


def _mpi(sync: str) -> Callable[[int, list[str]], list[str]]:
    def cmd(n: int, args: list[str]) -> list[str]:
        from loom.launch.commands import local_mpiexec

        return local_mpiexec([*PY, "--parallel.dp_impl=mpi", f"--parallel.mpi_sync={sync}", *args], n)

    return cmd


@dataclass(frozen=True)
class Strategy:
    """A way to train on several processes. Data-parallel strategies give their own command; the model-
    parallel ones give degrees and flags, and put the whole world on their own axis (tp, pp) by default."""

    name: str
    command: Callable[[int, list[str]], list[str]] | None = None  # (world size, common args) -> argv
    min_world: int = 2
    tp: int = 1
    pp: int = 1
    flags: tuple[str, ...] = ()
    dp_impl: str = "ddp"

    def degrees(self, n: int) -> tuple[int, int, int]:
        """(dp, tp, pp) at world size n."""
        tp, pp = self.tp, self.pp
        if self.name in ("tp", "tp-sp"):
            tp = n
        elif self.name.startswith("pp-"):
            pp = n
        elif self.name == "tp-pp":
            pp = n // tp
        return max(1, n // (tp * pp)), tp, pp

    def argv(self, n: int, args: list[str]) -> list[str]:
        if self.command is not None:
            return self.command(n, args)
        _, tp, pp = self.degrees(n)
        return [*PY, f"--nproc={n}", f"--parallel.tp={tp}", f"--parallel.pp={pp}",
                f"--parallel.dp_impl={self.dp_impl}", *self.flags, *args]  # fmt: skip


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in [
        *(
            Strategy(k, lambda n, a, k=k: [*PY, f"--nproc={n}", f"--parallel.dp_impl={k}", *a])
            for k in ("ddp", "zero1", "zero2", "fsdp")
        ),
        Strategy("mpi-naive", _mpi("naive")),
        Strategy("mpi-bucketed", _mpi("bucketed")),
        Strategy("tp", tp=2),
        Strategy("tp-sp", tp=2, flags=("--parallel.sp=true",)),
        *(
            Strategy(f"pp-{k}", pp=2, flags=(f"--parallel.pp_schedule={k}",))
            for k in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
        ),  # fmt: skip
        Strategy("dp-tp", min_world=4, tp=2, dp_impl="fsdp"),
        Strategy("dp-pp", min_world=4, pp=2),
        Strategy("tp-pp", min_world=4, tp=2, pp=2, flags=("--parallel.sp=true",)),
        Strategy("dp-tp-pp", min_world=8, tp=2, pp=2, dp_impl="fsdp"),
    ]
}


def common_args(data: Path, out: Path, steps: int) -> list[str]:
    return [
        f"--data.path={data}", f"--run.dir={out}", "--model.n_layer=4", "--model.n_head=4", "--model.n_embd=64",
        "--model.block_size=32", "--model.dropout=0.0", "--train.batch_size=16", "--train.micro_batch_size=4",
        f"--train.steps={steps}", "--train.log_every=1", "--train.eval_every=0", "--train.sample_every=0",
        "--train.ckpt_every=0", "--optim.warmup_steps=5", "--optim.lr=1e-3", "--precision.dtype=fp32",
        "--train.device=cpu", "--force",
    ]  # fmt: skip


def prepare_data(out: Path) -> Path:
    """A small char-level set from the standard library, made once per output folder."""
    from loom.data.corpus import python_stdlib_files
    from loom.data.prepare import prepare

    data = out / "data"
    if not (data / "meta.json").is_file():
        prepare(python_stdlib_files()[:12], data, tokenizer="char", seed=0, force=True)
    return data


def _run(argv: list[str], log_path: Path) -> None:
    t0 = time.perf_counter()
    with open(log_path, "w") as f:
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise LoomError(f"'{' '.join(argv[:6])} ...' failed (exit {r.returncode}); log {log_path}:\n{tail}")
    log.info(f"  ran in {time.perf_counter() - t0:.1f}s")


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def _params(run: Path) -> dict[str, torch.Tensor]:
    from loom import checkpoint

    path = checkpoint.latest_valid(run / "ckpt")
    if path is None:
        raise LoomError(f"run '{run}' wrote no checkpoint")
    return checkpoint.load(path)[0]["model"]


def compare(ref: Path, run: Path) -> tuple[float, float]:
    a, b = _losses(ref), _losses(run)
    if len(a) != len(b):
        raise LoomError(f"{run.name} logged {len(b)} steps, the reference {len(a)}")
    dloss = max(abs(x - y) for x, y in zip(a, b, strict=True))
    pa, pb = _params(ref), _params(run)
    dparam = max((pa[k].double() - pb[k].double()).abs().max().item() for k in pa)
    return dloss, dparam


def plot(out_png: Path, runs: dict[str, Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ref = _losses(runs["reference"])
    for name, run in runs.items():
        ls = _losses(run)
        ax.plot(range(1, len(ls) + 1), ls, label=name, linestyle="-" if name == "reference" else "--")
        if name != "reference":
            ax2.semilogy(
                range(1, len(ls) + 1), [abs(x - y) + 1e-12 for x, y in zip(ls, ref, strict=True)], label=name
            )
    ax.set_ylabel("train loss")
    ax.legend()
    ax2.set_ylabel("|loss - reference|")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def _world(s: Strategy, nproc: int | None) -> int:
    """The world size strategy s runs at, after the checks the verify model (4 layers, 4 heads) imposes."""
    n = nproc or s.min_world
    if n < s.min_world:
        raise LoomError(f"strategy {s.name} needs at least {s.min_world} processes; --nproc is {n}")
    dp, tp, pp = s.degrees(n)
    if (
        dp * tp * pp != n
        or 16 % (4 * dp)
        or tp > 4
        or pp * (2 if "interleaved" in s.name or "zero" in s.name else 1) > 4
    ):
        raise LoomError(
            f"strategy {s.name} cannot use {n} processes (dp {dp} x tp {tp} x pp {pp}) with the verify model "
            "(4 layers, 4 heads, global batch 16 in micro-batches of 4)",
            hint=f"use --nproc {s.min_world}",
        )
    return n


def verify_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loom verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default="ddp", help=f"comma list of: {', '.join(STRATEGIES)}")
    p.add_argument("--nproc", type=int, default=None,
                   help="world size (default: each strategy's smallest: 2, 4 for dp-tp/dp-pp/tp-pp, 8 for dp-tp-pp)")  # fmt: skip
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None, help="output folder (default runs/verify-<time>)")
    p.add_argument("--data", default=None, help="a prepared data directory (default: a small built-in set)")
    p.add_argument("--tol-loss", type=float, default=1e-6, help="max |loss - reference| to pass")
    p.add_argument("--tol-param", type=float, default=1e-5, help="max |param - reference| to pass")
    p.add_argument("--json", default=None, help="write the table as JSON records")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise LoomError(
            f"unknown strategy {', '.join(unknown) or '(none)'}", hint=f"known: {', '.join(STRATEGIES)}"
        )
    worlds = {n: _world(STRATEGIES[n], args.nproc) for n in names}  # every check before any run
    out = Path(args.out or f"runs/verify-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else prepare_data(out)
    common = common_args(data, out, args.steps)
    runs = {"reference": out / "reference"}
    log.info("reference: 1 process, micro-batch 4, 4 accumulation steps")
    _run([*PY, "--run.name=reference", "--parallel.dp_impl=none", *common], out / "reference.log")
    for name in names:
        n = worlds[name]
        dp, tp, pp = STRATEGIES[name].degrees(n)
        log.info(f"{name}: {n} processes (dp {dp} x tp {tp} x pp {pp}), micro-batch 4, "
                 f"{16 // (4 * dp)} {'pipeline micro-batches' if pp > 1 else 'accumulation step(s)'}")  # fmt: skip
        runs[name] = out / name
        _run(STRATEGIES[name].argv(n, [f"--run.name={name}", *common]), out / f"{name}.log")
    records = []
    for name in names:
        dloss, dparam = compare(runs["reference"], runs[name])
        ok = dloss <= args.tol_loss and dparam <= args.tol_param
        dp, tp, pp = STRATEGIES[name].degrees(worlds[name])
        records.append({"strategy": name, "world_size": worlds[name], "dp": dp, "tp": tp, "pp": pp,
                        "grad_accum": 16 // (4 * dp), "max_abs_dloss": dloss, "max_abs_dparam": dparam,
                        "passed": ok})  # fmt: skip
    _table(records, args.tol_loss, args.tol_param, args.steps)
    plot(out / "verify.png", runs)
    log.info(f"loss curves: {out / 'verify.png'}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0 if all(r["passed"] for r in records) else 1


def _table(records: list[dict], tol_loss: float, tol_param: float, steps: int) -> None:
    from rich.table import Table

    t = Table(
        title=f"loom verify: {steps} steps fp32 vs 1 process (tolerance loss {tol_loss:g}, param {tol_param:g})"
    )
    for col in ("strategy", "world", "dp·tp·pp", "micro", "max |Δloss|", "max |Δparam|", "result"):
        t.add_column(col, no_wrap=True)
    for r in records:
        t.add_row(r["strategy"], str(r["world_size"]), f"{r['dp']}·{r['tp']}·{r['pp']}", str(r["grad_accum"]),
                  f"{r['max_abs_dloss']:.3e}",
                  f"{r['max_abs_dparam']:.3e}", "pass" if r["passed"] else "FAIL")  # fmt: skip
    log.console().print(t)
