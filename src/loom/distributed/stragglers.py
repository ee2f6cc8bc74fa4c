"""Which rank is slow, and in what: per-rank phase times and the straggler monitor (issues 48 and 59).

`PhaseClock` times the phases of this rank's steps (data wait, forward, backward, exposed communication, optimizer,
the rest of the step, and the waits for peers inside collectives) with no synchronisation of its own: the data wait
on the host clock (the host is what waits), the others as device spans (`loom.device.Span`: events on a GPU, the
host clock on a CPU). `take()` adds up the spans that have ended on the device and keeps the rest for the next
call, so it never waits for the device (on a GPU the optimizer's span of the step just issued usually moves on to
the next window).

Waits (issue 59). Ranks wait for the slowest one inside collectives, and under DDP that wait hides in the backward:
the gradient all-reduce overlaps it, so a rank that waits shows a long backward, not a long `comm`. `BucketWaits`
times DDP's buckets from its communication hook: each bucket's span runs from its launch (this rank's gradients of
the bucket are ready) to its future's completion (every rank's are, and the sum is back). What runs past the last
launch, max(done) - max(launched), is the time this rank's backward waited for its peers after its own compute
ended: it is the step's `wait`, and the backward keeps only its compute. The step's blocking scalar collectives
(the loss and the stop/skip agreement) are timed as `wait` too, and `other` is what the step spent outside every
phase (the loss scaler, the step's records; gradient clipping is the `optimizer`'s), so a rank stopped anywhere in
its step shows its delay in a phase of its own compute. Anywhere but inside a collective: a rank stopped there
(SIGSTOP, starved of a CPU) holds every rank in it, and all show the same wait. On the host clock `Stalls` (a
thread that notices when the process did not run) takes that share out of the rank's `wait` into `stalled`, its own
time: on a busy 2-core machine a tiny model's rank spends ~40 % of its step in collectives.

`StragglerMonitor` adds them up per window of train.straggler_every steps, then sends them to rank 0 in one small
gather (the control plane). Rank 0 compares each rank's compute phases (every phase but `wait`) with the median of
the other ranks': a rank's excess is what it spends above them, phase by phase, and the rank with the largest
excess is the one the others wait for (their `wait` holds its excess). Where the waits are measured (DDP; FSDP and
the pipeline on the host clock, below) two ranks suffice: the waiting rank's phases hold its compute only. Where
they are not (the wait stays inside the phase of the collective), a rank waiting for the slow one shows the same
excess elsewhere, and naming needs three ranks or more. A pipeline's stages do different work by design: a stage
with more of it is named as the one the others wait for, which it is.

FSDP and the pipeline (issue 59). On the host clock (CPU, gloo) FSDP2's all-gathers and reduce-scatters and the
pipeline schedule's waits on its sends and receives block the training thread inside the forward or the backward:
`BlockedWaits` times each such block (FSDP's comms are replaced by `timed_fsdp`'s subclasses of its default ones,
which call the same collective with the same tensors; the schedule's wait on its P2P work is wrapped by
`timed_pipeline`; the step's own blocking collectives there, the pipeline's tied embedding/head and the gradient
norm, by `Parallel.blocked`), and `take()` moves it from the phase it ran in to `wait`. Then two ranks suffice
there too. Not on a GPU: there the collectives run on FSDP's and NCCL's streams and the host does not block in them
(the compute stream's wait is not observable without synchronising), so the waits stay in the phase as before; nor
with tensor, context or expert parallel (collectives these hooks do not see): `waits_measured` is then false and
naming needs three ranks. HSDP's all-reduce across replicas is timed like the rest.

Issue 49 (exposed communication on slow links) reads the same numbers: `PhaseClock` and `judge()` are the API.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loom import device as dev
from loom import log

PHASES = ("data", "forward", "backward", "comm", "optimizer", "other", "stalled", "wait")
COMPUTE = PHASES[:-1]  # what a rank spends on its own work; `wait` is what it spends on its peers'


class Stalls:
    """When this process did not run at all (stopped by a signal, starved of a CPU, a paused VM), on the host
    clock: a daemon thread sleeps TICK_S at a time, and a wake-up more than GAP_S after the one before is a
    stall. A stall inside a collective is this rank's own lost time, yet it shows as a wait on every rank (the
    peers cannot finish the collective without it): `within` says how much of a wait it was."""

    TICK_S, GAP_S = 0.005, 0.03

    def __init__(self):
        self.gaps: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, name="loom-stalls", daemon=True).start()

    def _watch(self) -> None:
        last = time.perf_counter()
        while True:
            time.sleep(self.TICK_S)
            now = time.perf_counter()
            if now - last > self.GAP_S:
                with self.lock:
                    self.gaps.append((last + self.TICK_S, now))
            last = now

    def within(self, a: float, b: float) -> float:
        """Seconds of [a, b] (perf_counter) this process was stalled."""
        with self.lock:
            return sum(max(0.0, min(b, e) - max(a, s)) for s, e in self.gaps)

    def forget(self, before: float) -> None:
        with self.lock:
            self.gaps = [g for g in self.gaps if g[1] >= before]


def _interval(span) -> tuple[float, float]:
    """A host-clock span's (start, end) on perf_counter; an Exposed wait's, from its last launch."""
    if isinstance(span, Exposed):
        return span.spans[-1].t0, max(s.t0 + getattr(s, "dt", 0.0) for s in span.spans)
    return span.t0, span.t0 + span.dt


class Exposed:
    """The wait of one step's DDP buckets: from the last launch to the last completion (seconds, >= 0), on
    the host clock or the device's events, like the spans it is made of."""

    def __init__(self, spans: list[dev.Span], sign: float = 1.0):
        self.spans, self.sign = spans, sign

    def done(self) -> bool:
        return all(s.done() for s in self.spans)

    def seconds(self) -> float:
        last = self.spans[-1]  # DDP launches its buckets in order
        if last.events:
            wait = max(last.a.elapsed_time(s.b) for s in self.spans) / 1000
        else:
            wait = max(s.t0 + getattr(s, "dt", 0.0) for s in self.spans) - last.t0
        return self.sign * max(0.0, wait)

    def negated(self) -> Exposed:
        return Exposed(self.spans, -self.sign)


class BucketWaits:
    """Times DDP's gradient buckets from its communication hook (`wrap` a hook: loom.parallel.ddp registers it);
    `take()` after a step: the step's Exposed wait, or None when no bucket was sent (a no_sync micro-step)."""

    def __init__(self, device):
        self.device, self.spans = device, []

    def wrap(self, hook):
        """`hook` (DDP's comm-hook signature) with each bucket's span from its launch to its future's end;
        the gradients are the hook's own, untouched."""

        def timed(state, bucket):
            span = dev.Span(self.device).start()
            self.spans.append(span)

            def done(fut):
                span.stop()  # on CPU/gloo: gloo's thread, the moment the bucket's sum is back
                return fut.value()

            return hook(state, bucket).then(done)

        return timed

    def take(self) -> Exposed | None:
        spans, self.spans = self.spans, []
        return Exposed(spans) if spans else None

    def entries(self) -> list[tuple[str, Exposed]]:
        """The step's (phase, span) pairs for PhaseClock: the wait, and the same taken out of the backward."""
        exposed = self.take()
        return [] if exposed is None else [("wait", exposed), ("backward", exposed.negated())]


class Blocked:
    """A span of host time (perf_counter) the training thread spent blocked in a collective; `sign` -1: the
    same taken out of the phase it ran in."""

    def __init__(self, t0: float, t1: float, sign: float = 1.0):
        self.t0, self.dt, self.sign = t0, t1 - t0, sign

    def done(self) -> bool:
        return True

    def seconds(self) -> float:
        return self.sign * self.dt


class BlockedWaits:
    """The host's time blocked inside collectives that run within a compute phase (FSDP2's all-gathers and
    reduce-scatters on gloo: `timed_fsdp`; the pipeline's waits on its sends and receives: `timed_pipeline`),
    each noted with the phase it ran in (PhaseClock sets `phase`). On the host clock only: on a GPU these
    calls return before the device has waited (see the module docstring)."""

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []
        self.phase: Callable[[], str | None] = lambda: None  # the timed phase running now (PhaseClock's)

    @contextlib.contextmanager
    def blocked(self):
        """Time the block (inside a timed phase; outside one, an eval or a checkpoint, it is not a step's)."""
        phase = self.phase()
        if phase is None:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append((phase, t0, time.perf_counter()))

    def entries(self) -> list[tuple[str, Blocked]]:
        """The step's (phase, span) pairs for PhaseClock: each block as a wait, and out of its phase."""
        spans, self.spans = self.spans, []
        return [e for phase, a, b in spans for e in (("wait", Blocked(a, b)), (phase, Blocked(a, b, -1.0)))]


def timed_fsdp(modules, waits: BlockedWaits) -> bool:
    """Time FSDP2's all-gathers and reduce-scatters of `modules` (each a fully_shard-ed module) in `waits`: each
    module's comms become subclasses of FSDP's defaults whose call is the default's (the same collective on
    the same tensors and group: numerics unchanged), inside `waits.blocked()`; HSDP's all-reduce across
    replicas too (compat.wrap_fsdp_all_reduce: the same call, timed). False (nothing changed) where
    this torch has no custom comms or a module has several parameter groups."""
    from loom import compat

    defaults = compat.fsdp_default_comms()
    modules = list(modules)
    if defaults is None or not modules or not all(hasattr(m, "set_custom_all_gather") for m in modules):
        return False
    if any(compat.fsdp_param_groups(m) != 1 for m in modules):
        return False
    all_gather, reduce_scatter = defaults

    class TimedAllGather(all_gather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            with waits.blocked():  # async_op (unshard_async_op, which loom leaves off): only the launch
                return super().__call__(output_tensor, input_tensor, group, async_op)

    class TimedReduceScatter(reduce_scatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            with waits.blocked():
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

    def timed_all_reduce(original):  # HSDP's all-reduce of the reduce-scattered shards across replicas
        def timed(*args, **kwargs):
            with waits.blocked():
                return original(*args, **kwargs)

        return timed

    if not compat.wrap_fsdp_all_reduce(timed_all_reduce):
        return False
    for m in modules:
        m.set_custom_all_gather(TimedAllGather())
        m.set_custom_reduce_scatter(TimedReduceScatter())
    return True


def timed_pipeline(waits: BlockedWaits) -> bool:
    """Time the pipeline schedules' waits on their send and receive work in `waits` (the same waits, in the
    same order; for the process: one pipeline per training process). False where this torch cannot."""
    from loom import compat

    def wrap(original):
        def timed(work):
            with waits.blocked():
                return original(work)

        return timed

    return compat.wrap_pipeline_p2p_wait(wrap)


class PhaseClock:
    """This rank's seconds per phase. `with clock("forward"): ...` around each piece; `take()` after a step.

    With `mark` set (while a profile is taken: loom.train.profile), each phase is also a torch.profiler range
    named `loom/<phase>`; a phase outside PHASES ("checkpoint") is marked, never timed."""

    def __init__(
        self,
        device,
        enabled: bool = True,
        waits: BucketWaits | BlockedWaits | None = None,
        stalls: bool = False,
    ):
        """`waits`: DDP's buckets, or FSDP's / the pipeline's blocked collectives (None: the waits inside phases
        are unmeasured); `stalls`: watch for this process not running (Stalls; on the host clock only: a
        device's events never see the host stop)."""
        self.device, self.enabled, self.mark = device, enabled, False
        self.waits = waits if enabled else None
        self.running: list[str] = []  # the phases open now, innermost last (BlockedWaits asks)
        if isinstance(self.waits, BlockedWaits):
            self.waits.phase = self._running
        host = not dev.Span(device).events
        self.stalls = Stalls() if enabled and stalls and host else None
        self.pending: list[tuple[str, dev.Span | Exposed]] = []

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
            self.running.append(phase)
            try:
                yield
            finally:
                self.running.pop()
                if span is not None:
                    self.pending.append((phase, span.stop()))

    def _running(self) -> str | None:
        """The innermost timed phase open now, if it is one a collective's wait can be taken out of."""
        phase = self.running[-1] if self.running else None
        return phase if phase in COMPUTE else None

    def take(self, step_s: float | None = None) -> dict[str, float]:
        """Seconds per phase of the spans that have ended; spans still running on the device stay for later.
        DDP's bucket wait moves from the backward to `wait` (FSDP's and the pipeline's blocked collectives from
        the phase they ran in), and what of a wait this process was stalled to
        `stalled`; `step_s` (the step's host time): what it spent outside every phase is `other`."""
        if self.waits is not None:
            self.pending += self.waits.entries()
        out, keep = dict.fromkeys(PHASES, 0.0), []
        for phase, span in self.pending:
            if span.done():
                out[phase] += span.seconds()
                if phase == "wait" and self.stalls is not None:
                    stalled = self.stalls.within(*_interval(span))
                    out["wait"] -= stalled
                    out["stalled"] += stalled
            else:
                keep.append((phase, span))
        self.pending = keep
        if self.stalls is not None:
            self.stalls.forget(before=time.perf_counter() - 60)  # a step's waits are long over by then
        if step_s is not None:
            out["other"] = max(0.0, step_s - sum(out.values()))
        return out


@dataclass
class Verdict:
    """A window's comparison of the ranks: per-rank seconds per step, by phase; the slowest rank when its
    excess over the other ranks' medians passes the threshold (else None), and how long the others waited
    in collectives (their median `wait`, as a fraction of the median step)."""

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
    waits_measured: bool = False  # every rank timed its waits inside DDP's backward (BucketWaits)
    wait_frac: float = 0.0

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
                "others_wait_frac": self.wait_frac,
            }
        return {
            "step": self.step,
            "stragglers": {
                "steps": self.steps,
                "step_s": self.totals,
                "phases_s": self.phases,
                "waits_measured": self.waits_measured,
                "slowest": slow,
            },
        }

    def line(self) -> str:
        return (
            f"step {self.step}: rank {self.rank} ({self.hosts[self.rank]}) is the slowest, "
            f"{1000 * self.excess_s:.1f} ms/step over the others' median ({100 * self.excess_frac:.0f}% of a "
            f"step), in {self.phase}; the others wait {100 * self.wait_frac:.0f}% of a step in collectives"
        )


def judge(step: int, gathered: list[dict], threshold: float) -> Verdict:
    """Compare the ranks' windows (each {"host", "steps", "phases": {phase: seconds}, "waits": measured}): the
    rank with the largest excess of compute (every phase but `wait`) over the other ranks' per-phase medians
    is named when that excess is above `threshold` of the median step time. Two ranks are compared only where
    both measured their waits (see the module docstring)."""
    n, steps = len(gathered), max(1, gathered[0]["steps"])
    hosts = [g["host"] for g in gathered]
    phases = {p: [g["phases"].get(p, 0.0) / steps for g in gathered] for p in PHASES}
    totals = [sum(phases[p][r] for p in PHASES) for r in range(n)]
    v = Verdict(step, steps, hosts, phases, totals=totals)
    v.waits_measured = all(g.get("waits", False) for g in gathered)
    if n < (2 if v.waits_measured else 3):
        return v

    def others(p: str, r: int) -> float:
        return statistics.median(phases[p][q] for q in range(n) if q != r)

    excess = [{p: max(0.0, phases[p][r] - others(p, r)) for p in COMPUTE} for r in range(n)]
    worst = max(range(n), key=lambda r: sum(excess[r].values()))
    total = sum(excess[worst].values())
    step_s = statistics.median(totals)
    if step_s > 0 and total > threshold * step_s:
        v.rank, v.excess_s, v.excess_frac = worst, total, total / step_s
        v.phase = max(COMPUTE, key=lambda p: excess[worst][p])
        v.wait_frac = others("wait", worst) / step_s
    return v


class StragglerMonitor:
    """After each step: add this rank's phase times; every `every` steps gather them on rank 0, which logs the
    slowest rank (and warns once it is named `windows` windows in a row) and writes the record."""

    def __init__(self, every: int, threshold: float, windows: int, control, write, waits: bool = False):
        """`waits`: this rank measures its waits inside the backward (DDP's BucketWaits)."""
        self.every, self.threshold, self.windows, self.waits = every, threshold, windows, waits
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
        mine = {"host": self.host, "steps": self.steps, "phases": self.sums, "waits": self.waits}
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
