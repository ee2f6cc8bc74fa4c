"""A rank stepped in full, or a few smaller steps and the plane through them: what makes 405B fit in a minute.

Two things repeat in a step and cost a CPU time in proportion: transformer blocks and pipeline micro-batches.

Blocks. A stage's blocks are alike (the same shapes, the same ops, one FSDP unit each), so everything a rank
holds or peaks at grows by the same bytes with each block: params, gradients and optimizer state by the block's
shards, the activations' peak and the total peak by what one more block keeps alive at the step's busiest
moment. A rank of more than 4 blocks is stepped with 3 and with 4 blocks per stage (the same world, layout,
batch and schedule) and each term is extended along the line to its own count. Not fewer: FSDP holds a few
whole blocks at once (the one in backward, the one it prefetches, and with full recomputation one more), so
the line starts at 3 (with Llama-3-405B widths and full recomputation, 2 -> 3 blocks added 760 MiB of gathered
parameters and every block after that none). A pipeline stage's line starts at 4: under torch's pipelining FSDP
keeps gradients unsharded from a stage's first backward, and with 3 blocks its 1F1B part peaks at another moment
(Llama-3-8B widths, tp 8 x pp 4 x fsdp 2, pipeline rank 0: 3 -> 4 blocks added 77 MB more than each block after).

Pipeline micro-batches. Under 1F1B pipeline rank r keeps w = pp - r micro-batches in flight; once a step has
w + 1 of them its steady phase (w in flight, the gradients allocated) is reached and then repeats, and what
still grows with each micro-batch is allocated per
micro-batch up front (the stage's receive buffers). So a 1F1B schedule of m micro-batches is stepped with m0
and m0 + 1 (m0 = w + 1, at least pp) and extended along the line to m. Blocks and micro-batches do not interact
once w saturates (w micro-batches in flight, whatever the blocks: Llama-3-8B, tp 8 x pp 4 x fsdp 2, each phase's
slope per micro-batch is the same with 1 and 4 blocks per stage), so the micro-batches' line is stepped on one
block per stage, the cheapest, and four steps span the plane.

Which moment of the step peaks can change with size: the head's backward (every block's activations held) grows
with each block, the end of the blocks' backward (FSDP's root reducing its gradients) does not, and on a pipeline
stage the warm-up's end and the 1F1B part that follows trade activations for FSDP's accumulated gradients. A line
through the peaks of the whole step would bend where one overtakes the other (Llama-3-70B, tp 8 x fsdp 64 with
full recomputation: at 3 and 4 blocks the end of backward peaks, at 80 the head's backward, 0.7 GiB higher). So
the step is marked into phases, each peaking at the same moment at any size (loom.dryrun.step: forward with the
head's backward, the blocks' backward, a pipeline's warm-up and its 1F1B part, the gradient sync and clip, the
update); each phase's peak is extended on its own and the largest taken.

Checked against full steps at the same world and layout (Llama-3-8B widths: FSDP over 64 with 4 and 6 blocks;
TP 8 x FSDP 8 with accumulation; TP 8 x PP 4 x FSDP 2, 1F1B with 16 micro-batches, pipeline rank 0 from 4 and
5 blocks to 8, and 3, 4, 5, 6 blocks stepped in full; Llama-3-405B widths, TP 8 x FSDP 128 with full
recomputation, 3 to 7 blocks): every term to the byte; tests/unit/test_dryrun.py checks both axes on a small
model. GPipe was not exact along its micro-batches (48 MiB in 5.7 GB on its last stage) and is stepped with all
of them, as are the interleaved schedules (two stages a rank, at different depths) and everything with --exact.

The steps of every rank role are independent: measure_roles runs them side by side, a child process each.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace

from loom.config import SCHEDULE_STAGES_PER_RANK, Config, validate
from loom.dryrun.step import RankMemory, eot_id, measure_rank
from loom.errors import LoomError
from loom.model.registry import spec_of

SMALL = (3, 4)  # blocks per stage of the two small models
SMALL_PIPELINE = (4, 5)  # the same for a pipeline stage (the module's docstring says why one more)
TERMS = ("params", "grads", "optim", "phases", "tracked", "ddp_buckets", "offloaded", "host_optim")


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


@dataclass(frozen=True)
class RolePlan:
    """The steps that measure one rank role, each (blocks per stage or None for the job's, micro-batches or None
    for the job's); the first is the base, and each axis (units, lo, hi) adds units x (steps[hi] - steps[lo])."""

    cfg: Config
    rank: int
    blocks: int  # blocks the rank holds in the job
    steps: list[tuple[int | None, int | None]]
    axes: list[tuple[int, int, int]]
    by_blocks: bool
    m0: int | None

    def step_cfg(self, k: int | None) -> Config:
        if k is None:
            return self.cfg
        p = self.cfg.parallel
        stages = p.pp * (SCHEDULE_STAGES_PER_RANK[p.pp_schedule] if p.pp > 1 else 1)
        return replace(self.cfg, model=replace(self.cfg.model, n_layer=k * stages))


def role_plan(cfg: Config, world: int, rank: int, vocab_size: int, exact: bool = False) -> RolePlan:
    """How rank `rank` is measured: stepped in full (exact, few blocks and micro-batches, interleaved
    schedules), or stepped small and extended along the blocks and the micro-batches (the module's docstring).
    With both axes the micro-batches' slope is measured on one block per stage: it is the same there (what
    grows with each micro-batch is the stage's receive buffers), at a fraction of the cost."""
    n = rank_blocks(cfg, world, rank, vocab_size)
    per_rank = SCHEDULE_STAGES_PER_RANK[cfg.parallel.pp_schedule] if cfg.parallel.pp > 1 else 1
    small = SMALL_PIPELINE if cfg.parallel.pp > 1 else SMALL
    by_blocks = not exact and per_rank == 1 and n > small[-1]
    m0 = None if exact else small_microbatches(cfg, world, rank)
    m = validate(cfg, world, rank)[0].pp_microbatches
    steps: list[tuple[int | None, int | None]] = [(small[0] if by_blocks else None, m0)]
    axes = []
    if by_blocks:
        steps.append((small[1], m0))
        axes.append((n - small[0], 0, 1))
    if m0 is not None:
        lo = 0 if not by_blocks else len(steps)
        if by_blocks:
            steps.append((1, m0))
        steps.append((1 if by_blocks else None, m0 + 1))
        axes.append((m - m0, lo, len(steps) - 1))
    return RolePlan(cfg, rank, n, steps, axes, by_blocks, m0)


def combine(plan: RolePlan, measured: list[RankMemory]) -> RankMemory:
    """The role's memory from its steps' (measured in plan.steps' order)."""
    out = extend(measured[0], [(units, measured[lo], measured[hi]) for units, lo, hi in plan.axes])
    return replace(
        out,
        blocks=plan.blocks,
        measured_blocks=[k for k, _ in plan.steps[:2]] if plan.by_blocks else [],
        measured_microbatches=[plan.m0, plan.m0 + 1] if plan.m0 is not None else [],
        seconds=sum(r.seconds for r in measured),
    )


def measure_roles(
    cfg: Config,
    world: int,
    ranks: list[int],
    vocab_size: int,
    precision: str,
    exact: bool = False,
    workers: int | None = None,
) -> list[RankMemory]:
    """Each rank's memory (role_plan, combine), every step in a child process of its own, `workers` at a time
    (default: the CPUs this process may use): the steps of all roles are independent."""
    plans = [role_plan(cfg, world, r, vocab_size, exact) for r in ranks]
    jobs = [
        (plan.step_cfg(k), world, plan.rank, vocab_size, precision, mbs)
        for plan in plans
        for k, mbs in plan.steps
    ]
    results = iter(measure_apart(jobs, workers))
    return [combine(plan, [next(results) for _ in plan.steps]) for plan in plans]


def extend(base: RankMemory, axes: list[tuple[int, RankMemory, RankMemory]]) -> RankMemory:
    """base + sum of units * (hi - lo) over the axes, term by term (bytes: integers, exactly)."""

    def at(u, *pairs):
        if isinstance(u, dict):
            return {key: at(u[key], *((lo[key], hi[key]) for lo, hi in pairs)) for key in u}
        return u + sum(units * (hi - lo) for (units, _, _), (lo, hi) in zip(axes, pairs, strict=True))

    out = {f.name: getattr(base, f.name) for f in fields(base)}
    for name in TERMS:
        out[name] = at(getattr(base, name), *((getattr(lo, name), getattr(hi, name)) for _, lo, hi in axes))
    return RankMemory(**out)


def measure_apart(jobs: list[tuple], workers: int | None = None) -> list[RankMemory]:
    """measure_rank(*job) for each job, each in a child process of its own (forked where the platform can:
    torch is imported once), up to `workers` at once: a fake process group of another rank cannot follow a
    destroyed one in the same process (names of its groups stay cached in torch), and what one rank's step
    leaves behind does not reach the next."""
    import multiprocessing as mp
    import os

    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    import loom.parallel  # noqa: F401  (imported once, before the fork, rather than in every child)

    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if "fork" in mp.get_all_start_methods():
        try:
            with _frozen_heap():
                return _measure_in(mp.get_context("fork"), jobs, workers)
        except _ForkRefused:  # a forked child could not run here (see _ForkRefused): measured again, spawned
            pass
    return _measure_in(mp.get_context("spawn"), jobs, workers)


@contextlib.contextmanager
def _frozen_heap():
    """This process's objects collected, then frozen (gc.freeze) while children are forked: a forked child's
    garbage collector then never visits what it inherited (the main tier once crashed a child with SIGSEGV
    while "Garbage-collecting" in its backward, objects of the pytest worker's earlier tests), and the pages
    stay shared."""
    import gc

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _ForkRefused(Exception):
    """A forked child could not run: its backward refused (autograd's device threads had started in the parent),
    or it died of a signal (SIGSEGV in both CI tiers, once with the child's garbage collector on its stack: what a
    fork copies of a long-lived process is not always safe to touch). Spawned children start clean."""


def _measure_in(ctx, jobs: list[tuple], workers: int) -> list[RankMemory]:
    from multiprocessing.connection import wait

    results: list = [None] * len(jobs)
    running: dict = {}  # connection -> (job index, process)
    todo = list(enumerate(jobs))
    try:
        while todo or running:
            while todo and len(running) < max(1, workers):
                i, job = todo.pop(0)
                here, there = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child, args=(there, job), daemon=True)
                proc.start()
                there.close()
                running[here] = (i, proc)
            for conn in wait(list(running)):
                i, proc = running.pop(conn)
                results[i] = _received(conn, proc, jobs[i][2], forked=ctx.get_start_method() == "fork")
    finally:
        for conn, (_, proc) in running.items():
            proc.kill()
            conn.close()
    return results


def _child(conn, job: tuple) -> None:
    import traceback

    try:
        conn.send(("ok", measure_rank(*job)))
    except LoomError as e:
        conn.send(("loom", (e.message, e.hint)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _received(conn, proc, rank: int, forked: bool = False) -> RankMemory:
    try:
        kind, value = conn.recv()
    except EOFError:
        proc.join()
        kind, value = "error", f"the process measuring rank {rank} died (exit code {proc.exitcode})"
        if forked and proc.exitcode is not None and proc.exitcode < 0:  # a signal: measured again, spawned
            raise _ForkRefused(value) from None
    conn.close()
    proc.join()
    if kind == "ok":
        return value
    if kind == "loom":
        raise LoomError(*value)
    if "Autograd-and-Fork" in value:  # torch's message when a forked child's backward cannot run
        raise _ForkRefused(value)
    raise RuntimeError(f"the dry run of rank {rank} failed:\n{value}")
