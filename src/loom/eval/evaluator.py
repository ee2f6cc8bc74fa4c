"""What the training loop asks of an evaluation: is it due after this step, and what did it find.

An evaluator owns its cadence and its work; the trainer only asks, after each step, every evaluator whose
`due(step, final)` is true to `run(ctx)`, then logs its `line` and writes its record to metrics.jsonl (rank 0).
Validation loss (val_loss.ValLossEval), HellaSwag (hellaswag.HellaSwagEval) and the sample of text
(loom.generate.Sampler) are evaluators; a new one (an lm-eval task, CORE) is a class with these three methods
and one line in the trainer's list. (torchtitan's validator and nanochat's per-stage evals play this part.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class EvalContext:
    """The job around the model, as an evaluator sees it (the same on every rank)."""

    parallel: Any  # loom.parallel.Parallelized: eval_model(), sampling(), all_reduce_sum, pipeline, dims
    device: torch.device
    step: int
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    tokenizer: Any = None  # the data's tokenizer, or None


class Evaluator(Protocol):
    name: str

    def due(self, step: int, final: bool) -> bool: ...

    def run(self, ctx: EvalContext) -> dict | None:
        """Called on every rank (an evaluation may be a collective); the fields to record, or None (nothing to
        record, or not on this rank)."""

    def line(self, step: int, record: dict) -> str: ...  # the console line for a record


@dataclass
class Every:
    """Due every `every` steps (0: never) and after the last step."""

    every: int
    in_metrics = True  # its records go to metrics.jsonl (the sampler's text goes to samples.txt instead)

    def due(self, step: int, final: bool) -> bool:
        return final or (self.every > 0 and step % self.every == 0)
