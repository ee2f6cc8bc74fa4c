"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr, or warmup-stable-decay (WSD: hold the
peak, then a linear fall to min_lr at the end, the speedruns' trapezoid). A pure function of the step."""

from __future__ import annotations

import math


def lr_at(
    step: int,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    total_steps: int,
    kind: str = "cosine",
    decay_frac: float = 0.3,
) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warm-up goes from lr/warmup to lr over `warmup_steps` (never 0, so step 0 already learns); the cosine
    then falls from lr to min_lr at the last step. WSD holds lr until the last decay_frac of the steps and
    falls linearly from there to min_lr at the last step.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if total_steps <= warmup_steps + 1:
        return lr
    if kind == "wsd":
        decay = max(1, round(decay_frac * total_steps))
        start = max(warmup_steps, total_steps - decay)
        if step < start:
            return lr
        ratio = min(1.0, (step - start + 1) / max(1, total_steps - start))
        return lr + ratio * (min_lr - lr)
    ratio = min(1.0, (step - warmup_steps) / (total_steps - 1 - warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
