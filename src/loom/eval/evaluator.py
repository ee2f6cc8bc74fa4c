"""What the training loop asks of an evaluation: is it due after this step, and what did it find.

An evaluator owns its cadence and its work; the trainer only asks, after each step, every evaluator whose
`due(step, final)` is true to `run(ctx)`, then logs its `line` and writes its record to metrics.jsonl (rank 0).
Validation loss (val_loss.ValLossEval: the loop's own, its last value is the run's summary), HellaSwag
(hellaswag.HellaSwagEval) and the sample of text (loom.generate.Sampler) are evaluators. Every evaluator but
the validation loss is made by a factory registered here (`register_evaluator`): a new one (an lm-eval task,
CORE) is a module with its class and one `register_evaluator` call, imported by the trainer or named in
LOOM_PLUGINS like a model family; the trainer's code does not change. (torchtitan's validator and nanochat's
per-stage evals play this part.)
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
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
    baseline = False  # also measured before a new run's first step (step 0: what training starts from)

    def due(self, step: int, final: bool) -> bool:
        return final or (self.every > 0 and step % self.every == 0)


@dataclass(frozen=True)
class EvalSetup:
    """What an evaluator's factory sees when the trainer starts, before the model is built, so that a bad input
    (a missing task file, text the tokenizer cannot encode) fails before any expensive work."""

    cfg: Any  # the run's loom.config.Config
    tokenizer: Any  # the data's tokenizer, or None
    data_dir: Path
    run_dir: Path
    main: bool  # rank 0: the rank that writes files
    model_cfg: Any  # the family's own model config (ModelSpec.config)
    spec: Any  # the family's loom.model.registry.ModelSpec
    stage: Any = None  # the run's training stage (loom.train.stage), for an evaluator that reports through it


EvaluatorFactory = Callable[[EvalSetup], "Evaluator | None"]  # None: not asked for by this run's config
_FACTORIES: dict[str, EvaluatorFactory] = {}


def register_evaluator(name: str, factory: EvaluatorFactory) -> EvaluatorFactory:
    """Make `factory` build the evaluator `name` for every training run (they run in registration order)."""
    _FACTORIES[name] = factory
    return factory


def build_evaluators(setup: EvalSetup) -> list[Evaluator]:
    """The registered evaluators this run's config asks for, in registration order."""
    return [ev for ev in (factory(setup) for factory in _FACTORIES.values()) if ev is not None]


def json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON-lines file; a line that is not JSON is refused
    with its file and line."""
    from loom.errors import LoomError

    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise LoomError(f"{path}:{n} is not JSON: {e}") from None
