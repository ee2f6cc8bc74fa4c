"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr. A pure function of the step."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based).

    Warm-up goes from lr/warmup to lr over `warmup_steps` (never 0, so step 0 already learns); the cosine
    then falls from lr to min_lr at the last step.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if total_steps <= warmup_steps + 1:
        return lr
    ratio = min(1.0, (step - warmup_steps) / (total_steps - 1 - warmup_steps))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
