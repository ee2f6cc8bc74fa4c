"""The dry run of a job: its layout checked, every rank role measured, one table with the planner beside it,
and the exit status (0: every rank fits; 1: one does not, with the rank, the term and a layout that fits; a
layout that cannot start raises the real job's LoomError, which the command line prints and exits 2 with)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from loom.config import Config, config_argv, explicit_keys, load_config
from loom.dryrun import layout
from loom.dryrun import torchao_states as torchao
from loom.dryrun.blocks import measure_roles
from loom.dryrun.layout import GIB, Target
from loom.dryrun.step import RankMemory

TERMS = (
    ("params", "params"),
    ("grads", "grads"),
    ("optim", "optim"),
    ("act_peak", "act@peak"),
    ("buffers", "bufs@peak"),
    ("peak", "peak"),
)
WHAT = {
    "params": "parameters",
    "grads": "gradients",
    "optim": "optimizer state",
    "act_peak": "activations",
    "buffers": "FSDP's unsharded parameters and gradients (DDP's buckets)",
}


@dataclass
class DryRun:
    cfg: Config
    target: Target
    precision: str
    ranks: list[RankMemory]
    planner: dict[str, float]  # bytes per term of the planner's fullest stage
    seconds: float
    advice: list[str] = field(default_factory=list)  # the flags of a layout the dry run found to fit
    tried: list[list[str]] = field(default_factory=list)  # the planner's layouts it found not to fit
    advice_seconds: float = 0.0  # spent dry-running the planner's layouts after this one did not fit

    def row(self, r: RankMemory) -> dict[str, int]:
        return {
            "params": r.params,
            "grads": r.grads,
            "optim": r.optim,
            "act_peak": r.act_peak,
            "buffers": r.at_peak["gathered"],
            "peak": r.peak,
        }

    @property
    def too_big(self) -> list[RankMemory]:
        return [r for r in self.ranks if r.peak > self.target.usable]

    def as_dict(self) -> dict:
        return {
            "world": self.target.world,
            "gpu": self.target.gpu,
            "gpu_mem_gib": self.target.gpu_mem_gib,
            "usable_bytes": self.target.usable,
            "precision": self.precision,
            "seconds": self.seconds,
            "advice_seconds": self.advice_seconds,
            "fits": not self.too_big,
            "ranks": [r.as_dict() for r in self.ranks],
            "planner": self.planner,
            "advice": self.advice,
            "tried": self.tried,
        }


def dry_run(
    cfg: Config,
    target: Target,
    cfg_path: str | None = None,
    overrides: list[str] = (),
    exact: bool = False,
    advise: bool = True,
) -> DryRun:
    """Check `cfg`'s layout on `target` as a real job would, then measure each rank role's step. When a rank
    does not fit, up to three of the planner's layouts are dry-run in turn (loom.dryrun.layout.next_layouts)
    and the first that fits is the advice."""
    t0 = time.perf_counter()
    dims = layout.check_layout(cfg, target)  # a layout that cannot start fails here, before anything else
    precision = layout.gpu_precision(cfg, target.gpu)
    vocab = layout.vocab_size(cfg)
    ranks = measure_ranks(cfg, dims, target, vocab, precision, exact)
    est = layout.planner_estimate(cfg, dims, target, vocab, precision)
    planner = {k: v * 1e9 for k, v in est.memory_gb.items()} if est is not None else {}
    result = DryRun(cfg, target, precision, ranks, planner, time.perf_counter() - t0)
    if result.too_big and advise:
        alternatives = layout.next_layouts(cfg, cfg_path, list(overrides), target, vocab, precision)
        for alt, flags in alternatives:
            alt_dims = layout.check_layout(alt, target)
            if (
                max(r.peak for r in measure_ranks(alt, alt_dims, target, vocab, precision, exact))
                <= target.usable
            ):
                result.advice = flags
                break
            result.tried.append(flags)
        result.advice_seconds = time.perf_counter() - t0 - result.seconds
    return result


def measure_ranks(
    cfg: Config, dims, target: Target, vocab: int, precision: str, exact: bool
) -> list[RankMemory]:
    """Every rank role of cfg's layout, measured (loom.dryrun.blocks.measure_roles: their steps side by side)."""
    run_cfg = layout.gpu_config(cfg, precision)
    roles = layout.ranks_to_measure(run_cfg, dims, vocab)
    measured = measure_roles(run_cfg, target.world, [r for r, _ in roles], vocab, precision, exact)
    return [replace(m, stands_for=stood) for m, (_, stood) in zip(measured, roles, strict=True)]


def _unit(result: DryRun) -> tuple[float, str]:
    top = max([r.peak for r in result.ranks] + [result.target.usable])
    return (GIB, "GiB") if top >= GIB else (2**20, "MiB")


def _origin(cfg: Config) -> str:
    """Where the model's weights come from and what trains of it (model.init_from, LoRA)."""
    f = cfg.finetune
    lora = f", LoRA rank {f.lora_rank} on {f.lora_targets} (the base frozen)" if f.lora_rank else ""
    return (f" from {cfg.model.init_from}" if cfg.model.init_from else "") + lora


def render(result: DryRun) -> str:
    """The table: one row per rank role, the planner's fullest stage below, and the verdict."""
    div, unit = _unit(result)
    t, p, m = result.target, result.cfg.parallel, result.cfg.model
    dp = t.world // (p.tp * p.pp * p.cp)
    lines = [
        f"model     {m.family} n_layer={m.n_layer} n_embd={m.n_embd} n_head={m.n_head} "
        f"n_kv_head={m.n_kv_head or m.n_head} block_size={m.block_size}{_origin(result.cfg)}",
        f"job       {t.world} GPUs ({t.gpus_per_node} per node), tp {p.tp}{' (sp)' if p.sp else ''} x pp {p.pp} "
        f"({p.pp_schedule}) x cp {p.cp} x dp {dp} ({p.dp_impl}), {result.precision}, activation checkpointing "
        f"{result.cfg.train.activation_checkpointing}, global batch {result.cfg.train.batch_size} x {m.block_size}",
        f"GPU       {t.gpu}, {t.gpu_mem_gib:g} GiB: {t.usable / div:.1f} {unit} usable ({t.headroom:.0%} headroom)",
        f"measured  one step on fake tensors (device 'cpu', the GPU's code path), {unit} per rank; planner: loom.plan",
        "          params, grads, optim: held after the step (as metrics.jsonl's mem_*); act@peak, bufs@peak: "
        "activations (with backward temporaries) and FSDP's unsharded parameters and gradients at the step's peak",
    ]
    head = (
        f"{'rank':>6} {'pp rank':>8} {'tp':>3} {'blocks':>7} |"
        + "".join(f"{name:>10}" for _, name in TERMS)
        + " |  fits      s"
    )
    lines += [head, "-" * len(head)]
    for r in result.ranks:
        row = result.row(r)
        fits = "yes" if r.peak <= t.usable else "NO"
        pp = _span(r.stands_for or [r.pp_rank])
        blocks = f"{r.blocks}{'*' if r.measured_blocks else ''}{'+' if r.measured_microbatches else ''}"
        lines.append(
            f"{r.rank:>6} {pp:>8} {r.tp_rank:>3} {blocks:>7} |"
            + "".join(f"{row[k] / div:>10.2f}" for k, _ in TERMS)
            + f" | {fits:>5} {r.seconds:>6.1f}"
        )
    lines += _planner_rows(result, div)
    if result.cfg.train.activation_offload:
        most = max(result.ranks, key=lambda r: r.offloaded)
        lines.append(
            f"offload   train.activation_offload: {most.offloaded / div:.2f} {unit} of saved activations per step "
            f"in host memory (rank {most.rank}; counted out of act@peak, copied back for the backward)"
            + (f"; planner: {result.planner['host'] / div:.2f} {unit}" if "host" in result.planner else "")
        )
    if counted := torchao.note(result.cfg):
        lines.append(counted)
    if any(r.host_optim for r in result.ranks):
        most = max(result.ranks, key=lambda r: r.host_optim)
        lines.append(
            f"offload   optim.offload: {most.host_optim / div:.2f} {unit} of optimizer state in host memory (rank {most.rank})"
        )
    for small in sorted({tuple(r.measured_blocks) for r in result.ranks if r.measured_blocks}):
        lines.append(
            f"* stepped with {small[0]} and {small[1]} blocks per stage, each term extended along the line "
            "(loom.dryrun.blocks)"
        )
    for r in result.ranks:
        if r.measured_microbatches:
            m0, m1 = r.measured_microbatches
            lines.append(
                f"+ rank {r.rank}: its 1F1B schedule stepped with {m0} and {m1} micro-batches and extended "
                "along the line to the job's (loom.dryrun.blocks)"
            )
    took = f"dry run took {result.seconds:.1f} s ({len(result.ranks)} rank roles)"
    if result.advice_seconds:
        took += f", then {result.advice_seconds:.1f} s on the planner's layouts"
    lines.append(took)
    lines += verdict(result, div, unit)
    return "\n".join(lines)


def _planner_rows(result: DryRun, div: float) -> list[str]:
    """The planner's estimate of the layout (its fullest stage) and the dry run's largest over it, by term."""
    pl = result.planner
    if not pl:
        return [f"{'planner':>27} | loom.plan has no estimate of this layout"]
    est = {
        "params": pl["params"],
        "grads": pl["grads"],
        "optim": pl["optim"],
        "act_peak": pl["activations"],
        "buffers": pl["buffers"],
        "peak": pl["total"],
    }
    fits = "yes" if pl["total"] <= result.target.usable else "NO"
    return [
        f"{'planner (fullest stage)':>27} |"
        + "".join(f"{est[k] / div:>10.2f}" for k, _ in TERMS)
        + f" | {fits:>5}",
        f"{'dry run / planner':>27} |" + "".join(_ratio(result, k, est[k]) for k, _ in TERMS),
    ]


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _ratio(result: DryRun, key: str, planned: float) -> str:
    """The rank that peaks highest (the one the planner's fullest stage stands for) over the planner, by term."""
    measured = result.row(max(result.ranks, key=lambda r: r.peak))[key]
    return f"{'-':>10}" if planned <= 0 else f"{measured / planned:>10.2f}"


def verdict(result: DryRun, div: float, unit: str) -> list[str]:
    """Every rank fits; or the rank that does not, its largest term, and the layout to try."""
    if not result.too_big:
        return [f"fits: every rank's peak is within {result.target.usable / div:.1f} {unit}"]
    out = []
    for r in result.too_big:
        row = result.row(r)
        term = max(WHAT, key=lambda k: row[k])
        out.append(
            f"DOES NOT FIT: rank {r.rank} (pipeline rank {r.pp_rank}, tp rank {r.tp_rank}) peaks at "
            f"{r.peak / div:.1f} {unit} > {result.target.usable / div:.1f} {unit} usable; its largest term "
            f"is {WHAT[term]} ({row[term] / div:.1f} {unit})"
        )
    for flags in result.tried:
        out.append("a layout of the planner's does not fit either (dry-run): " + " ".join(flags))
    if result.advice:
        out.append("a layout that fits (one of the planner's, dry-run): " + " ".join(result.advice))
    elif result.tried:
        out.append(
            "no layout the planner ranks next fits when dry-run: more or larger GPUs, a smaller batch per "
            "GPU, or a smaller model"
        )
    else:
        out.append(
            "the planner finds no layout of this world that fits: more or larger GPUs, or a smaller model"
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom train --dry-run",
        description="Build every rank role of the job on a fake process group of --world ranks and train one "
        "step on fake tensors under torch's memory tracker: does each rank fit its GPU?",
        epilog="Any config key can be set as --section.key=value, as for loom train. Exit status: 0 fits, 1 a "
        "rank does not fit, 2 the layout cannot start (the real job's error).",
    )
    p.add_argument("config", nargs="?", help="a TOML config file (configs/*.toml)")
    p.add_argument("--world", type=int, default=None, help="the job's number of GPUs (ranks)")
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="as --world: `loom train --nproc N ... --dry-run` dry-runs that job of N ranks",
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument(
        "--gpu", default="H100", help="GPU name: its bf16 support and default memory (default H100)"
    )
    p.add_argument("--gpu-mem", type=float, default=None, help="memory per GPU in GiB (default: the --gpu's)")
    p.add_argument(
        "--headroom", type=float, default=0.10, help="share of GPU memory kept free (default 0.10)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")
    p.add_argument(
        "--exact",
        action="store_true",
        help="step every block and micro-batch of every rank (default: ranks of more than 4 blocks are stepped "
        "with 3 and 4 and extended along the line, 1F1B schedules likewise along their micro-batches: "
        "loom.dryrun.blocks)",
    )
    return p


def target_of(args: argparse.Namespace) -> Target:
    from loom.errors import LoomError

    mem = args.gpu_mem
    if mem is None:
        mem = next((v for k, v in layout.GPU_MEM_GIB.items() if k.lower() in args.gpu.lower()), None)
        if mem is None:
            raise LoomError(f"no memory size known for GPU '{args.gpu}'", hint="give --gpu-mem GiB")
    for flag, v in {"--world": args.world, "--gpus-per-node": args.gpus_per_node, "--gpu-mem": mem}.items():
        if not v > 0:
            raise LoomError(f"{flag} must be positive, got {v}")
    if not 0 <= args.headroom < 1:
        raise LoomError(f"--headroom must be in [0, 1), got {args.headroom}")
    return Target(args.world, args.gpus_per_node, args.gpu, mem, args.headroom)


def init_from(cfg: Config, explicit: set[str]) -> None:
    """model.init_from's model, as training builds it (loom.train.finetune.resolve_init_from): its shape from
    the run or the transformers folder, and, with no data.path, the vocabulary of run:DIR's tokenizer (the
    data a fine-tuning run trains on may add chat tokens to it: give --data.path to count them)."""
    if not cfg.model.init_from:
        return
    from loom.runs import is_run_init, run_dir_of
    from loom.train.finetune import resolve_init_from

    resolve_init_from(cfg, explicit)
    if is_run_init(cfg) and not cfg.model.vocab_size and not cfg.data.path:
        from loom.data.loader import read_meta

        cfg.model.vocab_size = int(read_meta(run_dir_of(cfg) / "tokenizer")["vocab_size"])


def _world(args: argparse.Namespace) -> int:
    """--world N, or --nproc N (the option of the `loom train` command line the dry run was added to: the
    same job's ranks, so it is taken rather than read as the config file, as it was)."""
    from loom.errors import LoomError

    if args.world is not None and args.nproc is not None and args.world != args.nproc:
        raise LoomError(
            f"--world {args.world} and --nproc {args.nproc} disagree: both are the dry-run job's number of ranks",
            hint="give one of them",
        )
    world = args.world if args.world is not None else args.nproc
    if world is None:
        raise LoomError(
            "loom train --dry-run needs the job's number of ranks (GPUs)",
            hint="add --world N (or --nproc N, as for loom train), e.g. --world 8",
        )
    return world


def dryrun_main(argv: list[str]) -> int:
    """`loom train --dry-run --world N [--gpus-per-node G --gpu-mem GiB --gpu NAME] [config] [--k=v ...]`."""
    args, rest = build_parser().parse_known_args(argv)
    args.world = _world(args)
    args.config, rest = config_argv(argv, args.config, rest)
    cfg = load_config(args.config, rest)
    init_from(cfg, explicit_keys(args.config, rest))
    result = dry_run(cfg, target_of(args), args.config, rest, exact=args.exact)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_dict(), indent=1))
    return 1 if result.too_big else 0
