"""`loom verify`: the proof that N processes with the same global batch learn the same curve as one.

The same model is trained on the same data by one process (the reference) and by every requested
strategy; the loss curves and final parameters are compared. The reference runs with micro-batch
batch_size / 4 (4 accumulation steps) and the strategies with the same micro-batch, so dp=2 runs 2
accumulation steps and dp=4 one: a pass also shows gradient-accumulation invariance.

The model is a small built-in one (grown to as many layers as the requested pipeline stages need), or the
user's: `loom verify CONFIG --section.key=value ...` reads the config as `loom train` does and keeps its
model, data, optimizer and batch, with verify's own needs on top (fp32 unless a dtype other than auto is
asked for, dropout 0, its step count, a record every step, no eval or samples, one final checkpoint).

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
from loom.config import (
    FAMILIES,
    PP_SCHEDULES,
    SCHEDULE_STAGES_PER_RANK,
    Config,
    ParallelConfig,
    config_argv,
    load_config,
    parse_overrides,
    set_key,
    validate,
)
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
    cp: int = 1  # context-parallel degree; 0: the whole world
    ep: int = 1  # expert-parallel degree (a MoE model); 0: every data-parallel x cp rank, -2: half of them
    # not exact by design (compressed gradients, DiLoCo): judged by the final loss's relative gap (--tol-final)
    approx: bool = False

    def cp_at(self, n: int) -> int:
        """The context-parallel degree at world size n."""
        return n if self.cp == 0 else self.cp

    def ep_at(self, n: int) -> int:
        """The expert-parallel degree at world size n."""
        dp, _, _ = self.degrees(n)
        data = dp * self.cp_at(n)
        return data if self.ep == 0 else data // 2 if self.ep == -2 else self.ep

    @property
    def moe(self) -> bool:
        """Runs on a mixture-of-experts model (expert parallelism)."""
        return self.ep != 1

    def degrees(self, n: int) -> tuple[int, int, int]:
        """(dp, tp, pp) at world size n (dp x cp x tp x pp = n)."""
        tp, pp = self.tp, self.pp
        if self.name in ("tp", "tp-sp"):
            tp = n
        elif self.name.startswith("pp-"):
            pp = n
        elif self.name == "tp-pp":
            pp = n // tp
        return max(1, n // (tp * pp * self.cp_at(n))), tp, pp

    def argv(self, n: int, args: list[str]) -> list[str]:
        if self.command is not None:
            return self.command(n, args)
        _, tp, pp = self.degrees(n)
        return [
            *PY,
            f"--nproc={n}",
            f"--parallel.tp={tp}",
            f"--parallel.pp={pp}",
            f"--parallel.dp_impl={self.dp_impl}",
            *([f"--parallel.cp={self.cp_at(n)}"] if self.cp_at(n) > 1 else []),
            *([f"--parallel.ep={self.ep_at(n)}"] if self.ep != 1 else []),
            *self.flags,
            *args,
        ]


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in [
        *(
            Strategy(k, lambda n, a, k=k: [*PY, f"--nproc={n}", f"--parallel.dp_impl={k}", *a])
            for k in ("ddp", "zero1", "zero2", "fsdp")
        ),
        # HSDP: parameters sharded over 2 ranks within a replica, 2 replicas (world 4: replicate x shard)
        Strategy(
            "hsdp",
            lambda n, a: [*PY, f"--nproc={n}", "--parallel.dp_impl=fsdp", "--parallel.dp_replicate=2", *a],
            min_world=4,
        ),
        # slow links: compressed gradient all-reduce (DDP communication hooks), and DiLoCo across 2 replicas
        *(
            Strategy(f"ddp-{k}", flags=(f"--parallel.grad_compression={k}",), approx=True)
            for k in ("bf16", "fp16", "powersgd")
        ),
        Strategy(
            "diloco",
            flags=("--parallel.dp_replicate=2", "--parallel.diloco_inner_steps=5"),
            approx=True,
        ),
        # torchft replica groups of one process (loom.distributed.ft), every step over all of them (extra: ft)
        Strategy(
            "ft-ddp",
            lambda n, a: [*PY, f"--nproc={n}", "--ft.enabled=true", f"--ft.min_replicas={n}", *a],
        ),
        # torchft replica groups of 2 FSDP ranks each, HSDP's replicate dim (= hsdp bit for bit: test_ft_hsdp)
        Strategy(
            "ft-hsdp",
            lambda n, a: [
                *PY,
                f"--nproc={n}",
                "--parallel.dp_impl=fsdp",
                "--parallel.dp_replicate=2",
                "--ft.enabled=true",
                "--ft.min_replicas=2",
                *a,
            ],
            min_world=4,
        ),
        # DiLoCo across 2 torchft replica groups (one process each; FSDP inside past 2), the outer step through
        # the ft manager (= diloco bit for bit: test_ft_diloco); judged as diloco is
        Strategy(
            "ft-diloco",
            lambda n, a: [
                *PY,
                f"--nproc={n}",
                *(["--parallel.dp_impl=fsdp"] if n > 2 else []),
                "--parallel.dp_replicate=2",
                "--parallel.diloco_inner_steps=5",
                "--ft.enabled=true",
                "--ft.min_replicas=2",
                *a,
            ],
            approx=True,
        ),
        Strategy("mpi-naive", _mpi("naive")),
        Strategy("mpi-bucketed", _mpi("bucketed")),
        Strategy("tp", tp=2),
        Strategy("tp-sp", tp=2, flags=("--parallel.sp=true",)),
        *(Strategy(f"pp-{k}", pp=2, flags=(f"--parallel.pp_schedule={k}",)) for k in PP_SCHEDULES),
        Strategy("dp-tp", min_world=4, tp=2, dp_impl="fsdp"),
        Strategy("dp-pp", min_world=4, pp=2),
        Strategy("tp-pp", min_world=4, tp=2, pp=2, flags=("--parallel.sp=true",)),
        Strategy("dp-tp-pp", min_world=8, tp=2, pp=2, dp_impl="fsdp"),
        Strategy("cp-ulysses", cp=0, flags=("--parallel.cp_impl=ulysses",)),  # loom.parallel.context
        Strategy("cp-ring", cp=0, flags=("--parallel.cp_impl=ring",)),  # loom.parallel.ring
        # FSDP shards over dp_shard x cp; with tp (and pp) the cp ranks share FSDP's shards too
        Strategy("dp-cp", min_world=4, cp=2, dp_impl="fsdp", flags=("--parallel.cp_impl=ulysses",)),
        Strategy(
            "cp-tp", min_world=4, cp=2, tp=2, flags=("--parallel.cp_impl=ulysses", "--parallel.sp=true")
        ),
        # expert parallelism (a MoE model): the experts split over the data-parallel ranks, tokens by all-to-all
        Strategy("ep", ep=0),  # ddp for the rest; every data-parallel rank holds 1/ep of the experts
        Strategy("dp-ep", min_world=4, ep=-2),  # two replicas of each expert (ddp, all-reduced over efsdp)
        Strategy("ep-fsdp", ep=2, dp_impl="fsdp"),  # at 4 ranks the experts are FSDP-sharded over 2 as well
        Strategy("ep-tp", min_world=4, tp=2, ep=0),  # the MoE layers whole on each tp rank, split over dp
        # each stage's experts split over its data-parallel ranks; balanced by the bias only (no aux loss under pp)
        Strategy("ep-pp", min_world=4, pp=2, ep=0),
        Strategy("ep-cp", cp=0, ep=0, flags=("--parallel.cp_impl=ulysses",)),  # experts over the cp ranks
        Strategy(
            "dp-cp-tp-pp",
            min_world=16,
            cp=2,
            tp=2,
            pp=2,
            dp_impl="fsdp",
            flags=("--parallel.cp_impl=ulysses",),
        ),
    ]
}


# The built-in verify model: small enough for a few CPU processes, 4 micro-batches of 4 per step.
VERIFY_MODEL = [
    "--model.n_layer=4",
    "--model.n_head=4",
    "--model.n_embd=64",
    "--model.block_size=32",
    "--train.batch_size=16",
    "--optim.warmup_steps=5",
    "--optim.lr=1e-3",
]


def _expert_verify_model(cfg: Config) -> str:
    """Turn the built-in verify model into the first family with expert layers (the built-in moe's): its
    spec's verify_model keys over its preset; returns what was set."""
    from loom.config import apply_family
    from loom.model.registry import expert_parallel_families, get

    spec = get(expert_parallel_families()[0])
    set_key(cfg, "model.family", spec.name)
    apply_family(cfg, set())
    for k, v in spec.verify_model.items():
        set_key(cfg, f"model.{k}", v)
    return ", ".join(f"{k}={v}" for k, v in spec.verify_model.items())


def _splits_sequences_or_stages(s: Strategy, nproc: int | None) -> bool:
    """Strategy s cuts the model into pipeline stages or each sequence over cp ranks."""
    n = nproc or s.min_world
    return s.degrees(n)[2] > 1 or s.cp_at(n) > 1


def micro_batch(batch_size: int) -> int:
    """The reference's micro-batch: batch / 4 (4 accumulation steps), or the largest divisor below that."""
    return max(d for d in range(1, max(1, batch_size // 4) + 1) if batch_size % d == 0)


def _schedule_stages(s: Strategy, n: int) -> int:
    """Pipeline stages strategy s cuts the model into at world size n."""
    _, _, pp = s.degrees(n)
    sched = next(
        (f.split("=", 1)[1] for f in s.argv(n, []) if f.startswith("--parallel.pp_schedule=")),
        ParallelConfig().pp_schedule,
    )
    return pp * (SCHEDULE_STAGES_PER_RANK[sched] if pp > 1 else 1)


def run_config(config: str | None, overrides: list[str], steps: int) -> tuple[Config, list[str]]:
    """The config every run shares (parallel layout left to the strategies) and what verify changed in it.

    Without CONFIG the overrides apply to the built-in verify model; with one, defaults -> file -> overrides,
    exactly as `loom train` reads them."""
    user = load_config(config, overrides) if config else load_config(None, VERIFY_MODEL + overrides)
    notes = []
    if user.model.dropout:
        notes.append(f"model.dropout {user.model.dropout} -> 0 (dropout masks differ between layouts)")
    if user.precision.dtype == "auto":
        notes.append(
            "precision.dtype auto -> fp32 (auto is loom's default; verify compares exactly: ask for bf16/fp16 "
            "with --precision.dtype "
            "and widen --tol-loss)"
        )
    elif user.precision.dtype != "fp32":
        notes.append(f"precision.dtype={user.precision.dtype} as asked: expect differences above fp32's")
    if user.train.device == "auto":
        notes.append("train.device auto -> cpu (gloo; --train.device=cuda to verify on GPUs)")
    own = {
        "model.dropout": 0.0,
        "precision.dtype": "fp32" if user.precision.dtype == "auto" else None,
        "train.device": "cpu" if user.train.device == "auto" else None,
        "train.steps": steps,
        "train.micro_batch_size": micro_batch(user.train.batch_size),
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.sample_every": 0,
        "train.ckpt_every": 0,
        "train.resume": "no",
        "train.eval_batches": 1,
        "train.sample_tokens": 1,  # the end of a run always evaluates and samples
        "run.name": "",
        "metrics.tensorboard": False,
        "metrics.wandb": False,
    }
    for key, value in own.items():
        if value is not None:
            set_key(user, key, value)
    user.parallel = ParallelConfig(timeout_s=user.parallel.timeout_s)  # the strategies set the layout
    return user, notes


def config_args(cfg: Config) -> list[str]:
    """cfg as `--section.key=value` overrides of the defaults (the parallel section is the strategies'); the
    defaults of cfg's model.family, whose preset applies to every key not given."""
    out, default = [], Config().to_dict()
    default["model"].update(FAMILIES.get(cfg.model.family, {}))  # (the family itself differs: passed)
    for section, values in cfg.to_dict().items():
        for k, v in values.items():
            if v != default[section].get(k) and not (section == "parallel" and k != "timeout_s"):
                out.append(f"--{section}.{k}=" + (str(v).lower() if isinstance(v, bool) else str(v)))
    return out


def common_args(data: Path, out: Path, steps: int, cfg: Config | None = None) -> list[str]:
    cfg = cfg or run_config(None, [], steps)[0]
    return [*config_args(cfg), f"--data.path={data}", f"--run.dir={out}", "--force"]


def _prepare_hint(config: str | None, path: str) -> str:
    """The `loom data prepare` command a config's comments give for its data, else a generic one."""
    lines = Path(config).read_text(encoding="utf-8").splitlines() if config else []
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#") and "loom data prepare" in line:
            cmd = [line.lstrip("# ").split("loom data prepare", 1)[1]]
            while (
                cmd[-1].rstrip().endswith("\\")
                and i + 1 < len(lines)
                and lines[i + 1].lstrip().startswith("#")
            ):
                i += 1
                cmd[-1] = cmd[-1].rstrip()[:-1].rstrip()
                cmd.append(lines[i].lstrip("# ").strip())
            return f"prepare it as {config} says: loom data prepare" + " ".join(cmd) + " (or give --data DIR)"
    return f"prepare it with `loom data prepare --input YOUR_TEXT --out {path}`, or give --data DIR"


def check_data(path: str, config: str | None) -> Path:
    """The data directory every run reads, checked here so that a missing one is one error, before any run."""
    from loom.data.formats import check_dir

    try:
        check_dir(path)
    except LoomError as e:
        where = f" (the data.path of {config})" if config else ""
        raise LoomError(e.message + where, hint=_prepare_hint(config, path)) from None
    return Path(path)


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
    nproc = [a for a in argv if a.startswith("--nproc=")]
    # the one-process reference trains in this process on a CPU only: on a GPU, a CUDA context and the caching
    # allocator's memory would stay in this process, on rank 0's device, while the strategies run
    if argv[: len(PY)] == PY and (nproc or "--train.device=cpu" in argv):
        args = [a for a in argv[len(PY) :] if a not in nproc]
        code = _launch_here(int(nproc[0].split("=", 1)[1]) if nproc else None, args, log_path)
    else:
        with open(log_path, "w") as f:
            code = subprocess.run(
                argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            ).returncode
    if code != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise LoomError(f"'{' '.join(argv[:6])} ...' failed (exit {code}); log {log_path}:\n{tail}")
    log.info(f"  ran in {time.perf_counter() - t0:.1f}s")


def _launch_here(nproc: int | None, args: list[str], log_path: Path) -> int:
    """`loom train --nproc NPROC ARGS` (ARGS: overrides and --force) run by this process: it starts the workers
    itself (forks of its fork server, loom.train.spawn), without a `loom train` parent (one interpreter and
    torch import fewer per strategy, ~5 s of CPU). NPROC None: `loom train ARGS` (the one-process reference, on
    a CPU) trains in this process itself, ~3 s of CPU fewer than a child and the same curve to the bit (nothing else runs here meanwhile). Output goes
    to log_path as a subprocess's would: stdout and stderr (the workers inherit them) point at the log
    meanwhile, and an error is the line `loom train` prints, exit code 2. The signal handlers the launch or the
    trainer sets in this process are put back."""
    import os
    import signal
    import threading

    from loom.errors import EXIT_PREEMPTED
    from loom.train import RunRequest, run
    from loom.train.spawn import launch_local

    handlers = {
        s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    }
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(log_path, "w") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                overrides = [a for a in args if a != "--force"]
                explicit = frozenset(k for k, _ in parse_overrides(overrides))
                req = RunRequest(load_config(None, overrides), None, "--force" in args, explicit)
                if nproc is None:
                    return EXIT_PREEMPTED if run(req).get("stopped_by") else 0
                return launch_local(nproc, req, args)
            except LoomError as e:
                print(f"loom: error: {e}", file=sys.stderr)
                return 2
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])
        if threading.current_thread() is threading.main_thread():  # where the launch could set them
            for s, h in handlers.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)


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


def final_gap(ref: Path, run: Path) -> float:
    """(final loss - the reference's) / the reference's: how far a strategy that is not exact by design ends,
    signed (below 0: lower than one process; DiLoCo's outer momentum can do that)."""
    a, b = _losses(ref)[-1], _losses(run)[-1]
    return (b - a) / abs(a)


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


def _world(s: Strategy, nproc: int | None, cfg: Config | None = None) -> int:
    """The world size strategy s runs at, after every rule of the layout for the model cfg (the run's model,
    batch and micro-batch; default the built-in verify model), checked by config.validate() at that world size."""
    cfg = cfg or run_config(None, [], 1)[0]
    n = nproc or s.min_world
    if n < s.min_world:
        raise LoomError(f"strategy {s.name} needs at least {s.min_world} processes; --nproc is {n}")
    dp, tp, pp = s.degrees(n)
    m, t = cfg.model, cfg.train
    what = (
        f"strategy {s.name} cannot use {n} processes (dp {dp} x tp {tp} x pp {pp}) with this model "
        f"({m.n_layer} layers, {m.n_head} heads, global batch {t.batch_size} in micro-batches of "
        f"{t.micro_batch_size})"
    )
    if dp * s.cp_at(n) * tp * pp != n:
        raise LoomError(what, hint=f"use --nproc {s.min_world}")
    layout = Config(**{f: getattr(cfg, f) for f in ("run", "data", "model", "train", "optim", "precision")})
    for k, v in parse_overrides([a for a in s.argv(n, []) if a.startswith("--parallel.")]):
        set_key(layout, k, v, from_text=True)
    try:
        validate(layout, n)
    except LoomError as e:
        raise LoomError(f"{what}: {e.message}", hint=e.hint or f"use --nproc {s.min_world}") from None
    return n


def _check_args(args: argparse.Namespace) -> None:
    """Counts, tolerances and output paths, before any run: --nproc 0 is not 'the default'."""
    from loom.env import oversubscription
    from loom.paths import check_output_dir, check_output_file

    if args.nproc is not None and args.nproc < 1:
        raise LoomError(
            f"--nproc must be >= 1, got {args.nproc}", hint="leave it out for each strategy's smallest"
        )
    if args.nproc is not None and (warning := oversubscription(args.nproc)):
        log.warn(warning)
    tols = {"--tol-loss": args.tol_loss, "--tol-param": args.tol_param, "--tol-final": args.tol_final}
    for flag, v in tols.items():
        if not v >= 0:
            raise LoomError(f"{flag} must be >= 0, got {v}")
    check_output_dir(args.out or "runs", "--out")
    if args.json:
        check_output_file(args.json, "--json")


def _expert_model(cfg: Config, names: list[str], args, overrides: list[str], notes: list[str]) -> None:
    """Strategies with expert parallelism need a family with expert layers: the built-in verify model becomes
    one (a user's model that has none is refused), with its keys for strategies that cut sequences or stages."""
    from loom.model.registry import spec_of

    if not any(STRATEGIES[n].moe for n in names) or spec_of(cfg).expert_parallel:
        return
    if args.config or any(k.startswith("model.") for k, _ in parse_overrides(overrides)):
        raise LoomError(
            f"strategies {', '.join(n for n in names if STRATEGIES[n].moe)} need a model with expert "
            f"layers; this one is model.family={cfg.model.family}",
            hint="set model.family=moe (and its model.n_experts, moe_* keys), or leave the model to verify",
        )
    notes.append(
        f"the verify model is a mixture of experts ({_expert_verify_model(cfg)}): expert parallelism"
    )
    # the family's keys for strategies that cut sequences or stages (a MoE's balance loss is per sequence
    # on the last stage: refused under pp and cp, and the reference drops it too)
    split = [n for n in names if STRATEGIES[n].moe and _splits_sequences_or_stages(STRATEGIES[n], args.nproc)]
    changed = {k: v for k, v in spec_of(cfg).verify_split.items() if getattr(cfg.model, k) != v}
    if split and changed:
        for k, v in changed.items():
            set_key(cfg, f"model.{k}", v)
        keys = ", ".join(f"{k}={v}" for k, v in changed.items())
        notes.append(f"{keys} ({', '.join(split)}: no balance loss under pipeline or context parallel)")


def verify_main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    args.config, overrides = config_argv(argv, args.config, overrides)  # `--train.steps 5`: 5 is no file
    if args.steps < 1:
        raise LoomError(f"--steps must be >= 1, got {args.steps}")
    _check_args(args)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        raise LoomError(
            f"unknown strategy {', '.join(unknown) or '(none)'}", hint=f"known: {', '.join(STRATEGIES)}"
        )
    cfg, notes = run_config(args.config, overrides, args.steps)
    _expert_model(cfg, names, args, overrides, notes)
    _fit_pipeline(cfg, names, args, overrides, notes)
    worlds = {n: _world(STRATEGIES[n], args.nproc, cfg) for n in names}  # every check before any run
    data_path = args.data or cfg.data.path
    data = check_data(data_path, None if args.data else args.config) if data_path else None
    out = Path(args.out or f"runs/verify-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    data = data or prepare_data(out)
    common = common_args(data, out, args.steps, cfg)
    m = cfg.model
    log.info(
        f"model: {m.n_layer} layers, {m.n_head} heads, n_embd {m.n_embd}, block {m.block_size}; "
        f"batch {cfg.train.batch_size}; {cfg.precision.dtype} on {cfg.train.device}; data {data}"
    )
    for note in notes:
        log.info(f"verify: {note}")
    runs = _run_all(cfg, names, worlds, out, common)
    records = _records(cfg, names, worlds, runs, args)
    _table(records, args.tol_loss, args.tol_param, args.steps, cfg.precision.dtype)
    plot(out / "verify.png", runs)
    log.info(f"loss curves: {out / 'verify.png'}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    return 0 if all(r["passed"] for r in records) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom verify",
        description=__doc__.split("\n\n")[0],
        epilog="Any config key can be set as --section.key=value, as for loom train.",
    )
    p.add_argument(
        "config", nargs="?", help="a TOML config (as for loom train); default: the built-in verify model"
    )
    p.add_argument("--strategies", default="ddp", help=f"comma list of: {', '.join(STRATEGIES)}")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="world size (default: each strategy's smallest: 2, 4 for dp-tp/dp-pp/tp-pp, 8 for dp-tp-pp)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None, help="output folder (default runs/verify-<time>)")
    p.add_argument(
        "--data",
        default=None,
        help="a prepared data directory (default: the config's data.path, else a small built-in set)",
    )
    p.add_argument("--tol-loss", type=float, default=1e-6, help="max |loss - reference| to pass")
    p.add_argument("--tol-param", type=float, default=1e-5, help="max |param - reference| to pass")
    p.add_argument(
        "--tol-final",
        type=float,
        default=0.02,
        help="strategies that are not exact by design (ddp-bf16/fp16/powersgd, diloco): how much higher than "
        "the reference's their final loss may end, relative (default 0.02)",
    )
    p.add_argument("--json", default=None, help="write the table as JSON records")
    return p


def _fit_pipeline(cfg: Config, names: list[str], args, overrides: list[str], notes: list[str]) -> None:
    """The built-in verify model grows to as many layers as the deepest pipeline has stages."""
    built_in = not args.config and not any(k == "model.n_layer" for k, _ in parse_overrides(overrides))
    stages = {n: _schedule_stages(STRATEGIES[n], args.nproc or STRATEGIES[n].min_world) for n in names}
    if built_in and max(stages.values()) > cfg.model.n_layer:
        deepest = max(stages, key=stages.get)
        notes.append(
            f"the verify model grows from {cfg.model.n_layer} to {stages[deepest]} layers "
            f"({deepest} cuts it into {stages[deepest]} pipeline stages)"
        )
        cfg.model.n_layer = stages[deepest]


def _run_all(cfg: Config, names: list[str], worlds: dict, out: Path, common: list[str]) -> dict[str, Path]:
    """The reference (one process), then each strategy: {name: its run folder}."""
    B, micro = cfg.train.batch_size, cfg.train.micro_batch_size
    runs = {"reference": out / "reference"}
    log.info(f"reference: 1 process, micro-batch {micro}, {B // micro} accumulation steps")
    _run([*PY, "--run.name=reference", "--parallel.dp_impl=none", *common], out / "reference.log")
    for name in names:
        n = worlds[name]
        dp, tp, pp = STRATEGIES[name].degrees(n)
        cp = f"cp {STRATEGIES[name].cp_at(n)} x " if STRATEGIES[name].cp_at(n) > 1 else ""
        ep = f", experts over ep {STRATEGIES[name].ep_at(n)}" if STRATEGIES[name].moe else ""
        log.info(
            f"{name}: {n} processes (dp {dp} x {cp}tp {tp} x pp {pp}{ep}), micro-batch {micro}, "
            f"{B // (micro * dp)} {'pipeline micro-batches' if pp > 1 else 'accumulation step(s)'}"
        )
        runs[name] = out / name
        _run(STRATEGIES[name].argv(n, [f"--run.name={name}", *common]), out / f"{name}.log")
    return runs


def _records(cfg: Config, names: list[str], worlds: dict, runs: dict, args) -> list[dict]:
    """Each strategy's largest differences from the reference and whether they pass."""
    B, micro = cfg.train.batch_size, cfg.train.micro_batch_size
    records = []
    for name in names:
        dloss, dparam = compare(runs["reference"], runs[name])
        gap = final_gap(runs["reference"], runs[name]) if STRATEGIES[name].approx else None
        if gap is not None:
            ok = gap <= args.tol_final
        else:
            ok = dloss <= args.tol_loss and dparam <= args.tol_param
        dp, tp, pp = STRATEGIES[name].degrees(worlds[name])
        records.append(
            {
                "strategy": name,
                "world_size": worlds[name],
                "dp": dp,
                "cp": STRATEGIES[name].cp_at(worlds[name]),
                "ep": STRATEGIES[name].ep_at(worlds[name]),
                "tp": tp,
                "pp": pp,
                "grad_accum": B // (micro * dp),
                "max_abs_dloss": dloss,
                "max_abs_dparam": dparam,
                "final_loss_gap": gap,
                "passed": ok,
            }
        )
    return records


def _table(records: list[dict], tol_loss: float, tol_param: float, steps: int, dtype: str = "fp32") -> None:
    from rich.table import Table

    t = Table(
        title=f"loom verify: {steps} steps {dtype} vs 1 process (tolerance loss {tol_loss:g}, param {tol_param:g}); "
        "layout dp·cp·tp·pp"
    )
    for col in ("strategy", "world", "layout", "micro", "max |Δloss|", "max |Δparam|", "final gap", "result"):
        t.add_column(col, no_wrap=True)
    for r in records:
        t.add_row(
            r["strategy"],
            str(r["world_size"]),
            f"{r['dp']}·{r.get('cp', 1)}·{r['tp']}·{r['pp']}"
            + (f" ep {r['ep']}" if r.get("ep", 1) > 1 else ""),
            str(r["grad_accum"]),
            f"{r['max_abs_dloss']:.3e}",
            f"{r['max_abs_dparam']:.3e}",
            "-" if r.get("final_loss_gap") is None else f"{100 * r['final_loss_gap']:+.2f}% (judged)",
            "pass" if r["passed"] else "FAIL",
        )
    log.print_table(t)
