"""The trainer's metrics logger: it owns when a step is logged (every train.log_every steps, the last step, and
any step that was skipped or stops the run) and where its records go (the console line on rank 0, and the
metrics sinks once the run files are written). The trainer hands it every step's record and asks nothing."""

from __future__ import annotations

import torch

from loom import log
from loom.metrics import Sinks, format_step, peak_memory_bytes


class MetricsLogger:
    def __init__(self, every: int, device: torch.device):
        self.every, self.device = every, device
        self.sinks: Sinks | None = None  # rank 0's, opened with the run files (`open`)
        self.first = True  # the first step also reports what the model state holds

    def open(self, sinks: Sinks, step: int) -> None:
        """Rank 0's sinks; a resumed run (`step` > 0) marks metrics.jsonl, whose records of later steps are
        superseded by the steps this run trains again."""
        self.sinks = sinks
        if step > 0:
            sinks.mark_resumed(step)

    def due(self, step: int, final: bool) -> bool:
        """Whether the step's record is logged in any case (a skipped or stopping step is, too)."""
        return final or (self.every > 0 and step % self.every == 0)

    def after_step(self, rec: dict, final: bool) -> None:
        """The step's console line and record, when due."""
        if "compile_s" in rec:
            log.info(
                f"torch.compile: the first step (tracing and compiling forward and backward) took "
                f"{rec['compile_s']:.1f}s; left out of tokens/s"
            )
        if self.due(rec["step"], final) or "skipped" in rec or "spike" in rec or "stop" in rec:
            rec["mem_bytes"] = peak_memory_bytes(self.device)
            log.info(format_step(rec))
            self.write(rec)

    def write(self, rec: dict) -> None:
        """A record into the metrics sinks, when open (rank 0, once the run files are written)."""
        if self.sinks:
            self.sinks.write(rec)

    def close(self) -> None:
        if self.sinks:
            self.sinks.close()
            self.sinks = None
