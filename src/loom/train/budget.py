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

PROBE = 10  # steps timed before the choice (the first left out)


class TimeBudget:
    def __init__(
        self, cfg: Config, start_step: int, broadcast: Callable[[object], object], save: Callable[[], None]
    ):
        """`broadcast`: rank 0's value to every rank; `save`: writes the run's config again (rank 0)."""
        self.cfg, self.broadcast, self.save = cfg, broadcast, save
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
        if step < self.at:
            return
        self.active = False
        t = self.cfg.train
        mean = self.broadcast(sum(self.times) / max(len(self.times), 1))
        left = max(t.time_budget_s - mean * (step + 1), 0.0)  # the first step's time counted as one more
        steps = min(t.steps, step + int(left / mean + 1e-6))  # 1e-6: no step lost to float rounding
        log.info(
            f"train.time_budget_s={t.time_budget_s:g}: {mean:.3f} s a step over steps 2-{step}, so "
            f"{steps} steps{' (train.steps)' if steps == t.steps else f' instead of train.steps={t.steps}'}"
        )
        if steps != t.steps:
            t.steps = steps
            self.save()
