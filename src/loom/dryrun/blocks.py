"""A rank stepped in full, or a few smaller steps and the plane through them: what makes 405B fit in a minute.

Two things repeat in a step and cost a CPU time in proportion: transformer blocks and pipeline micro-batches.

Blocks. A stage's blocks are alike (the same shapes, the same ops, one FSDP unit each), so everything a rank
holds or peaks at grows by the same bytes with each block: params, gradients and optimizer state by the block's
shards, the activations' peak and the total peak by what one more block keeps alive at the step's busiest
moment. A rank of more than 4 blocks is stepped with 3 and with 4 blocks per stage (the same world, layout,
batch and schedule) and each term is extended along the line to its own count. Not fewer: FSDP holds a few
whole blocks at once (the one in backward, the one it prefetches, and with full recomputation one more), so
the line starts at 3 (with Llama-3-405B widths and full recomputation, 2 -> 3 blocks added 760 MiB of gathered
parameters and every block after that none).

Pipeline micro-batches. Under 1F1B pipeline rank r keeps w = pp - r micro-batches in flight; once a step has
w + 1 of them its steady phase (w in flight, the gradients allocated) is reached and then repeats, and what
still grows with each micro-batch is allocated per
micro-batch up front (the stage's receive buffers). So a 1F1B schedule of m micro-batches is stepped with m0
and m0 + 1 (m0 = w + 1, at least pp) and extended along the line to m. Blocks and micro-batches do not interact
once w saturates (w micro-batches in flight, whatever the blocks), so three steps span the plane.

Which phase of the step peaks can change with size (forward/backward, the gradient sync and clip, the update),
so each phase's peak is extended on its own and the largest taken.

Checked against full steps at the same world and layout (Llama-3-8B widths: FSDP over 64 with 4 and 6 blocks;
TP 8 x FSDP 8 with accumulation; TP 8 x PP 4 x FSDP 2, 1F1B with 16 micro-batches, pipeline ranks 0, 1 and 3;
Llama-3-405B widths, TP 8 x FSDP 128 with full recomputation, 3 to 7 blocks): every term to the byte; tests/unit/test_dryrun.py checks both axes on a small model. GPipe was not exact along
its micro-batches (48 MiB in 5.7 GB on its last stage) and is stepped with all of them, as are the interleaved
schedules (two stages a rank, at different depths) and everything with --exact.
"""

from __future__ import annotations

from dataclasses import fields, replace

from loom.config import SCHEDULE_STAGES_PER_RANK, Config, validate
from loom.dryrun.step import RankMemory, eot_id, measure_rank
from loom.errors import LoomError
from loom.model.registry import spec_of

SMALL = (3, 4)  # blocks per stage of the two small models
TERMS = ("params", "grads", "optim", "phases", "tracked", "ddp_buckets")


def rank_blocks(cfg: Config, world: int, rank: int, vocab_size: int) -> int:
    """How many transformer blocks rank `rank` holds: the family's own stage split of the meta model."""
    from loom.parallel.pipeline import stage_ids

    _, dims = validate(cfg, world, rank)
    spec = spec_of(cfg)
    model = spec.build_model(cfg, vocab_size, "meta", eot_id=eot_id(cfg, vocab_size))
    if not dims.pp_enabled:
        return len(spec.parallel.blocks(model))
    ids, n_stages = stage_ids(cfg.parallel.pp_schedule, dims.pp, dims.pp_rank)
    return sum(len(spec.parallel.blocks(st)) for st in spec.parallel.split_stages(model, ids, n_stages))


def small_microbatches(cfg: Config, world: int, rank: int) -> int | None:
    """m0 for this rank's schedule (see the module's docstring), or None: the schedule is stepped in full."""
    derived, dims = validate(cfg, world, rank)
    schedule, m = cfg.parallel.pp_schedule, derived.pp_microbatches
    if dims.pp == 1 or schedule != "1f1b":
        return None
    m0 = max(min(m, dims.pp - dims.pp_rank) + 1, dims.pp)  # at least pp: torch's 1F1B takes no fewer
    return m0 if m > m0 + 1 else None


def measure_role(
    cfg: Config, world: int, rank: int, vocab_size: int, precision: str, exact: bool = False
) -> RankMemory:
    """Rank `rank`'s memory: stepped in full (exact, few blocks and micro-batches, interleaved schedules), or
    stepped small and extended along the blocks and the micro-batches (see the module's docstring)."""
    n = rank_blocks(cfg, world, rank, vocab_size)
    per_rank = SCHEDULE_STAGES_PER_RANK[cfg.parallel.pp_schedule] if cfg.parallel.pp > 1 else 1
    stages = cfg.parallel.pp * per_rank
    by_blocks = not exact and per_rank == 1 and n > SMALL[-1]
    m0 = None if exact else small_microbatches(cfg, world, rank)
    m = validate(cfg, world, rank)[0].pp_microbatches

    def step(k: int | None, mbs: int | None) -> RankMemory:
        small = cfg if k is None else replace(cfg, model=replace(cfg.model, n_layer=k * stages))
        return measure_rank_apart(small, world, rank, vocab_size, precision, mbs)

    k0 = SMALL[0] if by_blocks else None
    base = step(k0, m0)
    steps, slopes = [base], []  # (steps along an axis, per unit)
    if by_blocks:
        more = step(SMALL[1], m0)
        steps.append(more)
        slopes.append((n - SMALL[0], more))
    if m0 is not None:
        more = step(k0, m0 + 1)
        steps.append(more)
        slopes.append((m - m0, more))
    out = extend(base, slopes)
    return replace(
        out,
        blocks=n,
        measured_blocks=list(SMALL) if by_blocks else [],
        measured_microbatches=[m0, m0 + 1] if m0 is not None else [],
        seconds=sum(r.seconds for r in steps),
    )


def extend(base: RankMemory, slopes: list[tuple[int, RankMemory]]) -> RankMemory:
    """base + sum of units * (more - base) over the axes, term by term (bytes: integers, exactly)."""

    def at(u, *vs):
        if isinstance(u, dict):
            return {key: at(u[key], *(v[key] for v in vs)) for key in u}
        return u + sum(units * (v - u) for (units, _), v in zip(slopes, vs, strict=True))

    out = {f.name: getattr(base, f.name) for f in fields(base)}
    for name in TERMS:
        out[name] = at(getattr(base, name), *(getattr(more, name) for _, more in slopes))
    return RankMemory(**out)


def measure_rank_apart(
    cfg: Config, world: int, rank: int, vocab_size: int, precision: str, n_microbatches: int | None = None
) -> RankMemory:
    """measure_rank in a child process of its own (forked where the platform can: torch is imported once):
    a fake process group of another rank cannot follow a destroyed one in the same process (names of its
    groups stay cached in torch), and what one rank's step leaves behind does not reach the next."""
    import multiprocessing as mp
    import traceback

    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    import loom.parallel  # noqa: F401  (imported once, before the fork, rather than in every child)

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    here, there = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            there.send(("ok", measure_rank(cfg, world, rank, vocab_size, precision, n_microbatches)))
        except LoomError as e:
            there.send(("loom", (e.message, e.hint)))
        except BaseException:
            there.send(("error", traceback.format_exc()))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    there.close()
    try:
        kind, value = here.recv()
    except EOFError:
        kind, value = (
            "error",
            f"the process measuring rank {rank} died (exit code {proc.join() or proc.exitcode})",
        )
    proc.join()
    if kind == "ok":
        return value
    if kind == "loom":
        raise LoomError(*value)
    raise RuntimeError(f"the dry run of rank {rank} failed:\n{value}")
