"""Which rank is slow, and in what: per-rank phase times and the straggler monitor (issue 48).

`PhaseClock` times the phases of this rank's steps (data wait, forward, backward, exposed communication,
optimizer) with no synchronisation of its own: the data wait on the host clock (the host is what waits), the
others as device spans (`loom.device.Span`: events on a GPU, the host clock on a CPU). `take()` adds up the
spans that have ended on the device and keeps the rest for the next call, so it never waits for the device
(on a GPU the optimizer's span of the step just issued usually moves on to the next window).

`StragglerMonitor` adds them up per window of train.straggler_every steps, then sends them to rank 0 in one
small gather (the control plane). Rank 0 compares each phase with its median over the ranks: a rank's excess is
what it spends above the median, phase by phase. Ranks wait for the slowest one inside a collective (DDP's
gradient all-reduce runs in the backward), so the others show the wait where the collective is, and the
median of that phase is the waiting time: the slow rank is the one whose own excess is largest, in the phase
it loses time in. With two ranks the median is the mean, and the slow rank and the rank waiting for it show
the same excess: naming needs three ranks or more. A pipeline's stages do different work by design: compare
its ranks with care.

Issue 49 (exposed communication on slow links) reads the same numbers: `PhaseClock` and `judge()` are the API.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
from dataclasses import dataclass, field

from loom import device as dev
from loom import log

PHASES = ("data", "forward", "backward", "comm", "optimizer")


class PhaseClock:
    """This rank's seconds per phase. `with clock("forward"): ...` around each piece; `take()` after a step.

    With `mark` set (while a profile is taken: loom.train.profile), each phase is also a torch.profiler range
    named `loom/<phase>`; a phase outside PHASES ("checkpoint") is marked, never timed."""

    def __init__(self, device, enabled: bool = True):
        self.device, self.enabled, self.mark = device, enabled, False
        self.pending: list[tuple[str, dev.Span]] = []

    @contextlib.contextmanager
    def __call__(self, phase: str, host: bool = False):
        """Time `phase` (one of PHASES); `host`: on the host clock (a wait of the host, not of the device)."""
        timed = self.enabled and phase in PHASES
        if not (timed or self.mark):
            yield
            return
        import torch

        marked = torch.profiler.record_function(f"loom/{phase}") if self.mark else contextlib.nullcontext()
        with marked:
            span = dev.Span(self.device, host=host).start() if timed else None
            try:
                yield
            finally:
                if span is not None:
                    self.pending.append((phase, span.stop()))

    def take(self) -> dict[str, float]:
        """Seconds per phase of the spans that have ended; spans still running on the device stay for later."""
        out, keep = dict.fromkeys(PHASES, 0.0), []
        for phase, span in self.pending:
            if span.done():
                out[phase] += span.seconds()
            else:
                keep.append((phase, span))
        self.pending = keep
        return out


@dataclass
class Verdict:
    """A window's comparison of the ranks: per-rank seconds per step, by phase; the slowest rank when its
    excess over the median passes the threshold (else None)."""

    step: int
    steps: int
    hosts: list[str]
    phases: dict[str, list[float]]  # phase -> seconds per step, one per rank
    rank: int | None = None
    phase: str = ""
    excess_s: float = 0.0
    excess_frac: float = 0.0
    in_a_row: int = 0
    totals: list[float] = field(default_factory=list)

    def record(self) -> dict:
        """The metrics.jsonl record ("stragglers": every rank's step time and phases; who is slow, if anyone)."""
        slow = None
        if self.rank is not None:
            slow = {
                "rank": self.rank,
                "host": self.hosts[self.rank],
                "phase": self.phase,
                "excess_s": self.excess_s,
                "excess_frac": self.excess_frac,
                "in_a_row": self.in_a_row,
            }
        return {
            "step": self.step,
            "stragglers": {
                "steps": self.steps,
                "step_s": self.totals,
                "phases_s": self.phases,
                "slowest": slow,
            },
        }

    def line(self) -> str:
        return (
            f"step {self.step}: rank {self.rank} ({self.hosts[self.rank]}) is the slowest, "
            f"{1000 * self.excess_s:.1f} ms/step over the median ({100 * self.excess_frac:.0f}% of a step), "
            f"in {self.phase}"
        )


def judge(step: int, gathered: list[dict], threshold: float) -> Verdict:
    """Compare the ranks' windows (each {"host", "steps", "phases": {phase: seconds}}): the rank with the
    largest excess over the per-phase medians is named when that excess is above `threshold` of the median
    step time."""
    steps = max(1, gathered[0]["steps"])
    hosts = [g["host"] for g in gathered]
    phases = {p: [g["phases"].get(p, 0.0) / steps for g in gathered] for p in PHASES}
    totals = [sum(phases[p][r] for p in PHASES) for r in range(len(gathered))]
    v = Verdict(step, steps, hosts, phases, totals=totals)
    if len(gathered) < 3:  # see the module docstring: two ranks cannot tell the slow one from its peer
        return v
    median = {p: statistics.median(ts) for p, ts in phases.items()}
    excess = [{p: max(0.0, phases[p][r] - median[p]) for p in PHASES} for r in range(len(gathered))]
    worst = max(range(len(gathered)), key=lambda r: sum(excess[r].values()))
    total = sum(excess[worst].values())
    step_s = statistics.median(totals)
    if step_s > 0 and total > threshold * step_s:
        v.rank, v.excess_s, v.excess_frac = worst, total, total / step_s
        v.phase = max(PHASES, key=lambda p: excess[worst][p])
    return v


class StragglerMonitor:
    """After each step: add this rank's phase times; every `every` steps gather them on rank 0, which logs the
    slowest rank (and warns once it is named `windows` windows in a row) and writes the record."""

    def __init__(self, every: int, threshold: float, windows: int, control, write):
        self.every, self.threshold, self.windows = every, threshold, windows
        self.control, self.write = control, write
        self.host = socket.gethostname()
        self.sums, self.steps = dict.fromkeys(PHASES, 0.0), 0
        self.last: int | None = None  # the rank named in the window before
        self.in_a_row = 0
        self.started = False

    def after_step(self, step: int, phases: dict[str, float]) -> Verdict | None:
        """Add a step; at the end of a window, the gather (every rank) and the verdict (rank 0's). The first step
        of the process is left out of its window: lazy set-ups (DDP's bucket rebuild, allocator growth) are not
        a slow rank."""
        if self.started:
            for p, t in phases.items():
                self.sums[p] += t
            self.steps += 1
        self.started = True
        if step % self.every:
            return None
        mine = {"host": self.host, "steps": self.steps, "phases": self.sums}
        self.sums, self.steps = dict.fromkeys(PHASES, 0.0), 0
        gathered = self.control.gather_object(mine)
        if gathered is None:  # not rank 0
            return None
        v = judge(step, gathered, self.threshold)
        self.in_a_row = (
            self.in_a_row + 1 if v.rank is not None and v.rank == self.last else int(v.rank is not None)
        )
        self.last, v.in_a_row = v.rank, self.in_a_row
        if v.rank is not None:
            log.info(v.line())
            if self.in_a_row >= self.windows:
                log.warn(
                    f"rank {v.rank} ({v.hosts[v.rank]}) has been the slowest rank, by more than "
                    f"{100 * self.threshold:.0f}% of a step, for {self.in_a_row} windows of {self.every} steps "
                    f"in a row (in {v.phase}): look at that host"
                )
        self.write(v.record())
        return v
