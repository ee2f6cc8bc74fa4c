"""`loom plan --check`: the planner's top layouts dry-run, the planner's estimate beside each measurement."""

from __future__ import annotations

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


def plan_check(model: str | None, shape, cluster, wl, cands, gpu: str = "H100") -> int:
    """Dry-run each candidate layout (loom.plan's ranking) and print the planner's total beside the dry run's
    largest rank peak. `model`: the --model given to loom plan (a CONFIG.toml's other keys are kept). Exit
    status 0 when the planner's first layout fits when dry-run, else 1."""
    path = model if model and model.endswith(".toml") else None
    base = [] if path else shape_overrides(shape, wl)
    target = Target(
        cluster.gpus, cluster.gpus_per_node, gpu, cluster.gpu_mem_gb * 1e9 / GIB, cluster.headroom
    )
    print(f"{'#':>2} {'layout':<92} {'planner GiB':>11} {'dry run GiB':>11} {'ratio':>6}  fits  s")
    first_fits = None
    for i, c in enumerate(cands, 1):
        flags = layout_flags(c)
        overrides = [*base, *flags]
        r = dry_run(load_config(path, overrides), target, path, overrides, advise=False)
        planned, peak = c.memory_gb["total"] * 1e9, max(x.peak for x in r.ranks)
        fits = "yes" if not r.too_big else "NO"
        first_fits = (not r.too_big) if first_fits is None else first_fits
        print(
            f"{i:>2} {' '.join(f.split('.', 1)[1] for f in flags):<92} {planned / GIB:>11.2f} {peak / GIB:>11.2f} "
            f"{peak / planned:>6.2f}  {fits:<4} {r.seconds:.0f}"
        )
    return 0 if first_fits else 1


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
