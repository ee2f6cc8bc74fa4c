"""Pipeline parallelism with `torch.distributed.pipelining`: this rank's stages, a schedule, a step, an eval.

The model side cuts the stages (the family's ParallelPlan, loom/model/registry.py; gpt2's and llama's:
balanced layer ranges, the embeddings on the first stage, the head on the last). One stage per rank (GPipe, 1F1B) or two in a loop (interleaved 1F1B,
interleaved zero-bubble: stage s on pipeline rank s mod pp). The schedule runs its own micro-batches, forward
and backward interleaved, so gradient accumulation is the schedule's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom import log
from loom.config import PP_SCHEDULES, SCHEDULE_STAGES_PER_RANK

# The method by which torch's PipelineStage learns its activations' shapes from a first run of the stage
# (torch 2.13: `_forward_metadata_inference`, torch 2.11: `_shape_inference`).
_SHAPE_RUNS = ("_forward_metadata_inference", "_shape_inference")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1), ignore_index=-1)


class MicroBatchLoss:
    """The schedule's loss of one micro-batch: the mean over its targets; with `scale` set (SFT: the loss is the
    global batch's sum over its trained targets divided by their count, loom.train.trainer) the sum over its
    targets times `scale`, which the trainer sets each step (the schedule divides the gradients by the number
    of micro-batches: scale_grads)."""

    def __init__(self):
        self.scale: float | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return lm_loss(logits, targets)
        flat = logits.float().flatten(0, 1)
        return F.cross_entropy(flat, targets.flatten(0, 1), ignore_index=-1, reduction="sum") * self.scale


def stage_ids(schedule: str, pp: int, pp_rank: int) -> tuple[list[int], int]:
    """(this rank's stage indices in the looped placement, the number of stages)."""
    per_rank = SCHEDULE_STAGES_PER_RANK[schedule]
    return [pp_rank + k * pp for k in range(per_rank)], pp * per_rank


def _shape_run_in_eval(pstage) -> None:
    """Run the stage's shape-learning forward in eval mode.

    Before the first step torch runs each stage once to learn its activations' shapes: torch 2.13 on real
    tensors with autograd (the first micro-batch on the first stage, uninitialised tensors after it), torch 2.11
    on meta tensors. In training mode that extra forward counts: a MoE layer adds its load to the step's
    balance statistics, so its bias moved differently from one process (`loom verify --strategies pp-gpipe`
    on a MoE: max |dparam| 4.7e-3 after 10 steps), and dropout draws from the generator. In eval mode a
    forward counts nothing; the shapes are the same."""
    name = next((n for n in _SHAPE_RUNS if hasattr(pstage, n)), None)
    if name is None:
        log.warn(
            "this torch's PipelineStage has none of "
            + ", ".join(_SHAPE_RUNS)
            + ": its shape-learning forward runs in training mode (a MoE's first step counts one more forward)"
        )
        return
    run = getattr(pstage, name)

    def in_eval(*args, **kwargs):
        mode = pstage.submod.training
        pstage.submod.eval()
        try:
            return run(*args, **kwargs)
        finally:
            pstage.submod.train(mode)

    setattr(pstage, name, in_eval)


class Pipeline:
    """This rank's stages under a schedule."""

    def __init__(
        self,
        stages: list[nn.Module],
        ids: list[int],
        n_stages: int,
        pp_group,
        device,
        schedule: str,
        n_microbatches: int,
    ):
        from torch.distributed import pipelining

        self.stages, self.device, self.n_microbatches = stages, device, n_microbatches
        self.holds_first, self.holds_last = 0 in ids, n_stages - 1 in ids
        pstages = [
            pipelining.PipelineStage(st, sid, n_stages, device, group=pp_group)
            for st, sid in zip(stages, ids, strict=True)
        ]
        for ps in pstages:
            _shape_run_in_eval(ps)
        cls = getattr(pipelining, PP_SCHEDULES[schedule][0])
        self.loss = MicroBatchLoss()
        self.schedule = cls(
            pstages[0] if len(pstages) == 1 else pstages, n_microbatches=n_microbatches, loss_fn=self.loss
        )

    def _run(self, fn, x, y, losses) -> None:
        # the first stage's input must be contiguous: torch 2.11's stage checks its strides against its meta
        args = (x.contiguous(),) if self.holds_first else ()
        kwargs = {"target": y, "losses": losses} if self.holds_last else {}
        # The losses come through `losses`; the outputs are never read. Returned, the last stage would keep every
        # micro-batch's logits to the end of the step and then a merged copy (Llama-3-8B, pp 4: 125 GiB a rank).
        fn(*args, return_outputs=False, **kwargs)

    def step(
        self, x: torch.Tensor, y: torch.Tensor, autocast, per_target: float | None = None
    ) -> torch.Tensor:
        """Forward and backward of the local batch; the mean micro-batch loss on the last stage, else 0.
        per_target (SFT): each trained target's weight in the step's loss (data-parallel ranks over the global
        batch's trained targets); None: every micro-batch's mean counts alike."""
        losses: list[torch.Tensor] = []
        self.loss.scale = None if per_target is None else per_target * self.n_microbatches
        with autocast():
            self._run(self.schedule.step, x, y, losses)
        if self.holds_last:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return torch.zeros((), device=self.device)

    @torch.no_grad()
    def val_loss(self, valset, micro_batch_size: int, autocast, all_reduce_sum) -> float:
        """Mean token loss over the validation set, forward-only through the schedule."""
        for st in self.stages:
            st.eval()
        self.loss.scale = None  # each micro-batch's mean, weighted by its targets below
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        full = micro_batch_size * self.n_microbatches
        for x, y in valset.batches(full):
            # The stages exchange fixed shapes: a short last batch is padded with ignored targets (-1).
            if len(x) < full:
                pad = full - len(x)
                x = torch.cat([x, x[:1].expand(pad, -1)])
                y = torch.cat([y, torch.full((pad, y.size(1)), -1, dtype=y.dtype)])
            losses: list[torch.Tensor] = []
            with autocast():
                self._run(self.schedule.eval, x.to(self.device), y.to(self.device), losses)
            if self.holds_last:
                for loss, yc in zip(losses, y.chunk(self.n_microbatches), strict=True):
                    n = int((yc != -1).sum())
                    if n:
                        total[0] += loss.double() * n
                        total[1] += n
        for st in self.stages:
            st.train()
        total = all_reduce_sum(total)
        return (total[0] / total[1]).item()
