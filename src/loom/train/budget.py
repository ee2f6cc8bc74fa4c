"""train.time_budget_s: train.steps chosen from the speed measured on this machine, so that a run (the demo,
a first try on a new machine) takes about that long whatever the CPU or GPU.

A component the trainer asks after every step (`after_step`). After the first `PROBE` steps (the first one,
which pays for warm-up and any compile, left out) the mean step time sets train.steps, never above the value
configured, and the run's config.toml is written again with it. The choice falls inside the learning-rate
warm-up (default 100 steps), which does not depend on the total: the schedule is then exactly the one a run
started with that many steps has. Evaluations and the final sample come on top of the budget. A resumed run
keeps the steps its config holds; with several ranks rank 0's measurement decides, broadcast to all.
"""

from __future__ import annotations

from collections.abc import Callable

from loom import log
from loom.config import Config
from loom.config.schedules import StepShape

PROBE = 10  # steps timed before the choice (the first left out)


def run_length_warnings(
    cfg: Config,
    rows_per_epoch: int | None,
    rows_per_step: int,
    rows_before: Callable[[int], int] | None = None,
) -> list[str]:
    """What a run's length hides, said at its start (and again when train.time_budget_s chose the steps): a
    warm-up longer than the run (the peak lr is never reached), and training data read more than once.
    `rows_per_epoch`: the training windows one pass over the data holds (None: a loader that does not say);
    `rows_before(n)`: the windows n steps read, when steps differ (train.batch_schedule)."""
    t, o, out = cfg.train, cfg.optim, []
    if t.steps < o.warmup_steps:  # lr_at: step k (0-based) of the warm-up is at lr * (k + 1) / warmup_steps
        out.append(
            f"{t.steps} steps < {o.warmup_steps} warm-up steps: the peak lr {o.lr:g} is never reached (the "
            f"last step's is {o.lr * t.steps / o.warmup_steps:.3g}); --optim.warmup_steps=N shortens the warm-up"
        )
    if rows_per_epoch:
        rows = rows_before(t.steps) if rows_before else t.steps * rows_per_step
        epochs = rows / rows_per_epoch
        if epochs > 1.05:  # a few percent over one pass is a rounding of the steps, not a second epoch
            block = cfg.model.block_size
            steps = (
                f"{t.steps} steps x {rows_per_step:,} rows of {block} tokens"
                if rows_before is None
                else f"{t.steps} steps, {rows:,} rows of {block} tokens (train.batch_schedule)"
            )
            out.append(
                f"the run reads its training tokens {epochs:.1f} times (epochs): {steps}, {rows_per_epoch:,} "
                "rows in the training split; more data, or fewer steps, if the validation loss starts to rise"
            )
    return out


class TimeBudget:
    def __init__(
        self,
        cfg: Config,
        start_step: int,
        broadcast: Callable[[object], object],
        save: Callable[[], None],
        chosen: Callable[[], None] = lambda: None,
        schedule: StepShape | None = None,
    ):
        """`broadcast`: rank 0's value to every rank; `save`: writes the run's config again (rank 0);
        `chosen`: called once train.steps is chosen (the trainer says what the run's length hides);
        `schedule`: train.batch_schedule's steps, which differ: the time is then measured per window and
        the steps chosen so that their windows fit (a warm-up's small first steps say little of the last)."""
        self.cfg, self.broadcast, self.save, self.chosen = cfg, broadcast, save, chosen
        self.schedule, self.windows = schedule, 0  # windows: those of the timed steps
        budget = cfg.train.time_budget_s
        # a resumed run already chose; a run of fewer steps than the probe has nothing to choose
        self.active = budget > 0 and start_step == 0 and cfg.train.steps > PROBE
        self.at = min(PROBE, max(2, cfg.optim.warmup_steps)) if self.active else 0
        self.times: list[float] = []

    def after_step(self, step: int, dt: float) -> None:
        if not self.active:
            return
        if step > 1:  # the first step pays for warm-up and compilation
            self.times.append(dt)
            self.windows += self.schedule.windows(step - 1) if self.schedule is not None else 1
        if step < self.at:
            return
        self.active = False
        t = self.cfg.train
        # seconds a step, or with a schedule a window of model.block_size tokens
        mean = self.broadcast(sum(self.times) / max(self.windows, 1))
        steps = self._steps(step, mean)
        per = f"{mean:.3f} s a step" if self.schedule is None else f"{mean:.3g} s a sequence (a schedule's)"
        log.info(
            f"train.time_budget_s={t.time_budget_s:g}: {per} over steps 2-{step}, so "
            f"{steps} steps{' (train.steps)' if steps == t.steps else f' instead of train.steps={t.steps}'}"
        )
        if steps != t.steps:
            t.steps = steps
            self.save()
        self.chosen()

    def _steps(self, step: int, mean: float) -> int:
        """The steps that fit the budget, `mean` seconds a step (a window with a schedule) measured after
        `step` steps; never more than train.steps."""
        t, schedule = self.cfg.train, self.schedule
        if schedule is None:
            left = max(t.time_budget_s - mean * (step + 1), 0.0)  # the first step's time counted as one more
            return min(t.steps, step + int(left / mean + 1e-6))  # 1e-6: no step lost to float rounding
        first = schedule.windows(0)  # the first step's time counted as one more, as above
        lo, hi = step, t.steps  # the most steps whose windows' time fits: windows_before only grows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if mean * (schedule.windows_before(mid) + first) <= t.time_budget_s + 1e-6:
                lo = mid
            else:
                hi = mid - 1
        return lo
