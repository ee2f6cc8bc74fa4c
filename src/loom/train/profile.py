"""`train.profile_start/steps/ranks`: torch.profiler Chrome traces of chosen steps on chosen ranks (issue 48).

A component the trainer asks before and after each step. While it traces, the trainer's phase clock marks
data, forward, backward, comm, optimizer and checkpoint (`loom/<phase>` ranges), so the trace reads by phase.
Each chosen rank writes RUN/profile/trace_step<first>-<last>_rank<r>.json (a run shorter than the window
stops the trace at its last step); rank 0 prints where they are and how to open them.
"""

from __future__ import annotations

from pathlib import Path

from loom import device as dev
from loom import log
from loom.config import Config
from loom.config.validate import rank_list


class StepProfiler:
    def __init__(self, cfg: Config, rank: int, world: int, run_dir: Path, device, clock):
        t = cfg.train
        self.first, self.last = t.profile_start, t.profile_start + t.profile_steps - 1
        self.ranks = rank_list(t.profile_ranks, world) if t.profile_start else []
        self.rank, self.run_dir, self.device, self.clock = rank, run_dir, device, clock
        self.prof = None

    def before_step(self, step: int) -> None:
        """`step`: the step about to run (1-based). Starts the trace at train.profile_start."""
        if step != self.first or self.rank not in self.ranks:
            return
        import torch

        self.prof = torch.profiler.profile(activities=dev.profiler_activities(self.device))
        with log.without_native_lines("USDT:"):  # kineto's start line, printed whatever its log level
            self.prof.start()
        self.clock.mark = True

    def after_step(self, step: int, final: bool) -> Path | None:
        """After the checkpointer: the trace's last step (or the run's) writes the file. Returns its path."""
        if self.prof is None or not (step >= self.last or final):
            return None
        with log.without_native_lines("USDT:"):
            self.prof.stop()
        self.clock.mark = False
        out = self.run_dir / "profile" / f"trace_step{self.first}-{step}_rank{self.rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(out))
        self.prof = None
        ranks = ",".join(map(str, self.ranks))
        log.info(
            f"profile of steps {self.first}-{step} (ranks {ranks}): {out} "
            "(open it in chrome://tracing or https://ui.perfetto.dev)"
        )
        return out
