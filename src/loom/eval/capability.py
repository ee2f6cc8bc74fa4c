"""Capability scores in the training loop: eval.tasks (lm-evaluation-harness) and eval.core_bundle (CORE),
every eval.every steps and at the end, each record in metrics.jsonl as `lm_eval/<task>/<metric>` and
`core`, `core/<task>` (`loom plot` draws the accuracies against tokens).

The tasks and the bundle are read when the trainer starts (an unknown task, missing data or a broken bundle
fails before the model is built). Which model answers, on which ranks:
  a whole model on every rank (one process, ddp, zero1): the harness splits the requests over the ranks;
  FSDP / ZeRO-2: the same split, the sharded forwards in lockstep (loom.eval.lm_adapter);
  tensor, pipeline or context parallel: rank 0 alone, on a whole copy gathered once (as the sample of text).
So `loom eval RUN --tasks ...` on the step-N checkpoint gives the record of step N.
"""

from __future__ import annotations

from loom.errors import LoomError
from loom.eval.evaluator import EvalContext, EvalSetup, Every, register_evaluator
from loom.eval.harness import split_names
from loom.plot import is_score  # the figures of the console line and of `loom plot` (all go to metrics.jsonl)


class CapabilityEval(Every):
    name = "capability"

    def __init__(self, tasks, core_tasks, limit: int | None, batch_size: int, every: int):
        super().__init__(every)
        self.tasks, self.core_tasks, self.limit, self.batch_size = tasks, core_tasks, limit, batch_size

    def run(self, ctx: EvalContext) -> dict | None:
        import torch.distributed as dist

        from loom.eval import harness

        par, dims = ctx.parallel, ctx.parallel.dims
        if (
            dims.model_parallel
            or dims.cp_enabled
            or dims.ep_enabled
            or (dims.world_size > 1 and not dist.is_initialized())
        ):
            # a split model: a whole copy on rank 0; dp_impl=mpi (no torch.distributed): rank 0's own copy
            model, rank, world, sharded = par.sampling_model(), 0, 1, False
            if model is None:
                return None
        else:
            model, rank, world = par.eval_model(), dims.rank, dims.world_size
            sharded = bool(par.fsdp_roots)
        lm = harness.make_lm(
            model,
            ctx.tokenizer,
            ctx.device,
            batch_size=self.batch_size,
            autocast=ctx.autocast,
            rank=rank,
            world_size=world,
            sharded=sharded,
            all_reduce_sum=par.all_reduce_sum,
        )
        was_training = model.training
        try:
            return scores(lm, self.tasks, self.core_tasks, self.limit)
        finally:
            model.train(was_training)

    def line(self, step: int, record: dict) -> str:
        keys = [k for k in record if is_score(k)] or list(record)  # accuracies, else what there is
        parts = [f"{k.removeprefix('lm_eval/')} {record[k]:.4f}" for k in keys]
        return f"step {step:>6} | " + " | ".join(parts)


def scores(lm, tasks, core_tasks, limit: int | None) -> dict | None:
    """The record of one evaluation (rank 0; None elsewhere): every harness metric and the CORE figures."""
    from loom.eval import core, harness

    results = harness.evaluate(lm, tasks, limit) if tasks is not None else None
    core_r = core.evaluate(lm, core_tasks) if core_tasks else None
    return record_of(results, core_r) if lm.rank == 0 else None


def record_of(results: dict | None, core_r: dict | None) -> dict:
    """{"lm_eval/<task>/<metric>": value, "core": CORE, "core/<task>": accuracy}: what metrics.jsonl and
    `loom eval`'s JSON record of the harness's results and of a CORE evaluation."""
    from loom.eval import harness

    record = {f"lm_eval/{k}": v for k, v in harness.scores(results).items()} if results is not None else {}
    if core_r is not None:
        record["core"] = core_r["core"]
        record |= {f"core/{label}": acc for label, acc in core_r["accuracy"].items()}
    return record


def load(cfg_eval, tokenizer):
    """(harness tasks or None, CORE tasks or None) of an [eval] config, read and checked now."""
    from loom.eval import core, harness

    if tokenizer is None:
        raise LoomError(
            "eval.tasks / eval.core_bundle need the data's tokenizer, and this data has none",
            hint="prepare the data with loom (or use nanogpt data with meta.pkl)",
        )
    limit = cfg_eval.limit or None
    tasks = None
    if split_names(cfg_eval.tasks):
        shots = None if cfg_eval.num_fewshot < 0 else cfg_eval.num_fewshot
        tasks = harness.load_tasks(cfg_eval.tasks, cfg_eval.include_path or None, shots)
        harness.check_encodable(tasks, tokenizer, limit)
    core_tasks = core.read_bundle(cfg_eval.core_bundle, limit) if cfg_eval.core_bundle else None
    return tasks, core_tasks


def _in_training(setup: EvalSetup) -> CapabilityEval | None:
    e = setup.cfg.eval
    if not (split_names(e.tasks) or e.core_bundle):
        return None
    tasks, core_tasks = load(e, setup.tokenizer)
    return CapabilityEval(tasks, core_tasks, e.limit or None, e.batch_size, e.every)


register_evaluator("capability", _in_training)
