"""`loom plan --check`: the planner's top layouts dry-run, the planner's estimate beside each measurement."""

from __future__ import annotations

import contextlib
import textwrap
import warnings

from loom.config import load_config
from loom.dryrun.layout import GIB, Target, layout_flags
from loom.dryrun.report import dry_run


def shape_overrides(shape, wl) -> list[str]:
    """loom config overrides for a loom.plan model shape and workload (sequence length, global batch, precision):
    every model key given, so the family's preset changes none of them."""
    m = {
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
        "n_embd": shape.n_embd,
        "vocab_size": shape.vocab_size,
        "block_size": wl.seq_len,
        "bias": str(shape.bias).lower(),
        "dropout": shape.dropout,
        "n_kv_head": shape.n_kv_head,
        "mlp": shape.mlp,
        "ffn_hidden": shape.ffn_hidden,
        "norm": shape.norm,
        "pos": shape.pos,
        "tie_embeddings": str(shape.tie_embeddings).lower(),
        "qk_norm": str(shape.qk_norm).lower(),
    }
    # the shape's family with its own keys (a MoE's experts: without them, gpt2 refused parallel.ep)
    if shape.family:
        from loom.model.registry import get

        m = {"family": shape.family, **m, **get(shape.family).shape_keys(shape)}
    dtype = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-pure": "bf16"}[
        wl.precision.name
    ]
    return [f"--model.{k}={v}" for k, v in m.items()] + [
        f"--train.batch_size={wl.global_batch_tokens // wl.seq_len}",
        f"--precision.dtype={dtype}",
    ]


WIDTH = 120  # every line of the check's table, its reasons and its warnings fits this many columns
LAYOUT_WIDTH = 74  # WIDTH less the other columns: a longer layout folds onto lines of its own
HEADER = f"{'#':>2} {'layout':<{LAYOUT_WIDTH}} {'planner GiB':>11} {'dry run GiB':>11} {'ratio':>6}  fits  s"


def plan_check(model: str | None, shape, cluster, wl, cands, gpu: str = "H100", extra: list[str] = ()) -> int:
    """Dry-run each candidate layout (loom.plan's ranking) and print the planner's total beside the dry run's
    largest rank peak; a layout the dry run finds too big says why under its row (the planner listed it as
    fitting: its verdict gives way to the measurement). What the dry runs warn about is printed after the table,
    once each. `model`: the --model given to loom plan (a CONFIG.toml's other keys are kept); `extra`: config
    overrides every dry run takes (a planned LoRA/QLoRA run's: loom.plan.report.finetune_overrides). Exit status 0 when
    the planner's first layout fits when dry-run, else 1."""
    path = model if model and model.endswith(".toml") else None
    base = [] if path else shape_overrides(shape, wl)
    target = Target(
        cluster.gpus, cluster.gpus_per_node, gpu, cluster.gpu_mem_gb * 1e9 / GIB, cluster.headroom
    )
    print(HEADER)
    first_fits = None
    held: list[str] = []
    with _warnings_held(held):
        for i, c in enumerate(cands, 1):
            flags = layout_flags(c)
            overrides = [*base, *extra, *flags]
            r = dry_run(load_config(path, overrides), target, path, overrides, advise=False)
            planned, peak = c.memory_gb["total"] * 1e9, max(x.peak for x in r.ranks)
            first_fits = (not r.too_big) if first_fits is None else first_fits
            layout = " ".join(f.split(".", 1)[1] for f in flags)
            for line in check_row(i, layout, planned, peak, r.seconds, None if not r.too_big else r):
                print(line)
    if held:
        print()
        for w in dict.fromkeys(held):  # each once, in the order first seen
            print(textwrap.fill(f"warning: {w}", WIDTH, subsequent_indent="  "))
    return 0 if first_fits else 1


def check_row(i: int, layout: str, planned: float, peak: float, seconds: float, too_big=None) -> list[str]:
    """One layout's lines: the row (its layout folded at LAYOUT_WIDTH), and for a dry run that does not fit
    (`too_big`: its DryRun) the dry run's verdict and reason, folded at WIDTH."""
    from loom.dryrun.report import verdict

    parts = textwrap.wrap(layout, LAYOUT_WIDTH, break_on_hyphens=False) or [""]
    fits = "NO" if too_big is not None else "yes"
    lines = [
        f"{i:>2} {parts[0]:<{LAYOUT_WIDTH}} {planned / GIB:>11.2f} {peak / GIB:>11.2f} {peak / planned:>6.2f}  "
        f"{fits:<4} {seconds:.0f}"
    ]
    lines += [f"   {p}" for p in parts[1:]]
    if too_big is not None:
        why = verdict(too_big, GIB, "GiB")[0]
        lines += textwrap.wrap(
            f"dry run: {why} (the planner's estimate, {planned / GIB:.2f} GiB, fitted: the dry run measures what "
            "loom's code holds)",
            WIDTH,
            initial_indent="   ",
            subsequent_indent="     ",
        )
    return lines


@contextlib.contextmanager
def _warnings_held(held: list[str]):
    """loom's warnings (log.warn, log.warn_once) and Python's during the dry runs, kept in `held` instead of
    printed between the rows."""
    from loom import log

    saved = log.warn, log.warn_once
    log.warn = log.warn_once = held.append
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            yield
    finally:
        log.warn, log.warn_once = saved
        held += [str(w.message).splitlines()[0] for w in caught]


def check_checkable(shape) -> None:
    """`loom plan --check` of a shape the dry run cannot step (its family's ModelSpec.no_dry_run: a mixture of
    experts) is refused before the plan is printed: the check it asked for could not follow."""
    if not shape.family:
        return
    from loom.model.registry import get

    why = get(shape.family).no_dry_run
    if why:
        from loom.errors import LoomError

        raise LoomError(
            f"loom plan --check dry-runs the planner's layouts, and the dry run cannot step {shape.name} "
            f"(model.family={shape.family}): {why}",
            hint="leave out --check for the planner's estimate (its expert memory and all-to-all assume a "
            "balanced router), or measure the layout on the devices",
        )
