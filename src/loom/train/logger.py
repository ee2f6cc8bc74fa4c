"""The trainer's metrics logger: it owns when a step is logged (every train.log_every steps, the last step, and
any step that was skipped or stops the run) and where its records go (the console line on rank 0, and the
metrics sinks once the run files are written). The trainer hands it every step's record and asks nothing.

Progress: each logged line says `step k/N`, the time since the run's first step and the time left at the pace so
far; on a terminal a progress line under the logged ones moves every step (rich, gone when the run ends). The
console's loss is the mean over the steps since the previous line (`loss_mean` in metrics.jsonl); `loss` stays
the logged step's own, which `loom verify` and the tests compare step by step."""

from __future__ import annotations

import math
import time

import torch

from loom import log
from loom.metrics import Sinks, format_step, peak_memory_bytes


class MetricsLogger:
    def __init__(self, every: int, device: torch.device):
        self.every, self.device = every, device
        self.sinks: Sinks | None = None  # rank 0's, opened with the run files (`open`)
        self.first = True  # the first step also reports what the model state holds
        self.losses: list[float] = []  # the finite losses since the last logged step: its loss_mean
        self.t0: float | None = None  # when this process's first step began (elapsed and ETA count from it)
        self.start_step = 0
        self.bar = None  # the terminal's progress line (rich), rank 0 only

    def open(self, sinks: Sinks, step: int) -> None:
        """Rank 0's sinks; a resumed run (`step` > 0) marks metrics.jsonl, whose records of later steps are
        superseded by the steps this run trains again."""
        self.sinks = sinks
        if step > 0:
            sinks.mark_resumed(step)

    def begin(self, step: int, total: int) -> None:
        """The run's steps start (at `step`, a resumed run's): the clock of elapsed time and the ETA, and on a
        terminal the progress line."""
        self.t0, self.start_step = time.perf_counter(), step
        con = log.console()
        if log.prints_console() and con.is_terminal and not log.shows_all_ranks():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=con,
                transient=True,  # the logged lines stay, the moving one goes
            )
            self.task = self.bar.add_task("train", total=total, completed=step)
            self.bar.start()

    def end(self) -> None:
        """The progress line gone (the run ended, or failed: called from the trainer's finally)."""
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def due(self, step: int, final: bool) -> bool:
        """Whether the step's record is logged in any case (a skipped or stopping step is, too)."""
        return final or (self.every > 0 and step % self.every == 0)

    def eta(self, step: int, total: int) -> float | None:
        """Seconds left at this run's pace so far (None before a step of this process has ended)."""
        done = step - self.start_step
        if self.t0 is None or done <= 0:
            return None
        return (time.perf_counter() - self.t0) / done * max(total - step, 0)

    def after_step(self, rec: dict, final: bool, total: int | None = None) -> None:
        """The step's console line and record, when due. `total`: the run's steps (train.steps)."""
        if "compile_s" in rec:
            log.info(
                f"torch.compile: the first step (tracing and compiling forward and backward) took "
                f"{rec['compile_s']:.1f}s; left out of tokens/s"
            )
        if math.isfinite(rec["loss"]):  # a skipped step's inf/NaN would hide the interval's mean
            self.losses.append(rec["loss"])
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], total=total)
        if self.due(rec["step"], final) or "skipped" in rec or "spike" in rec or "stop" in rec:
            rec["mem_bytes"] = peak_memory_bytes(self.device)
            if self.losses:
                rec["loss_mean"] = sum(self.losses) / len(self.losses)
                rec["loss_steps"] = len(self.losses)  # how many steps loss_mean averages
            self.losses = []
            if self.t0 is not None:
                rec["elapsed_s"] = time.perf_counter() - self.t0
            eta = None if total is None or final else self.eta(rec["step"], total)
            log.info(format_step(rec, total, eta))
            self.write(rec)

    def write(self, rec: dict) -> None:
        """A record into the metrics sinks, when open (rank 0, once the run files are written)."""
        if self.sinks:
            self.sinks.write(rec)

    def close(self) -> None:
        self.end()
        if self.sinks:
            self.sinks.close()
            self.sinks = None
