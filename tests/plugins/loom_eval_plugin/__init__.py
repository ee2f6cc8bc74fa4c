"""A plug-in evaluator (tests): the fraction of the validation windows' next tokens the model ranks first,
every 2 steps and at the end. One module and one `register_evaluator` call, loaded with
LOOM_PLUGINS=loom_eval_plugin: nothing in loom names it."""

from __future__ import annotations

import torch

from loom.eval.evaluator import EvalContext, EvalSetup, Every, register_evaluator


class TopOneEval(Every):
    name = "top1"

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        super().__init__(2)
        self.x, self.y = x, y

    def run(self, ctx: EvalContext) -> dict | None:
        model = ctx.parallel.eval_model()
        x, y = self.x.to(ctx.device), self.y.to(ctx.device)
        with torch.no_grad(), ctx.autocast():
            logits = model(x)[0]
        return {"top1": (logits.argmax(-1) == y).float().mean().item()}

    def line(self, step: int, record: dict) -> str:
        return f"step {step}: top-1 next-token accuracy {record['top1']:.3f}"


def _in_training(setup: EvalSetup) -> TopOneEval:
    from loom.data.loader import ValSet

    x, y = next(ValSet(setup.data_dir, setup.cfg.model.block_size, 4).batches(4))
    return TopOneEval(x, y)


register_evaluator("top1", _in_training)
