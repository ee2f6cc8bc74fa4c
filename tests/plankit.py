"""What the planner's tests compare a measured model with (tests/unit/test_plan.py, test_plan_moe.py)."""

from __future__ import annotations

from loom.plan import memory
from loom.plan.shapes import ModelShape


def model_activation_bytes(
    shape: ModelShape, s: int, b: int, act_bytes: int, attention: str = "flash", mask_bytes: int = 1
) -> float:
    """A whole single-device model for one forward without autocast (tp = pp = 1, no recomputation): the
    tensors saved for backward, as tests/unit/test_plan.py measures them: the planner's per-layer terms
    summed."""
    prec = memory.Precision("test", 4, 4, 8, act_bytes, "", autocast=False)
    m = memory.Micro(s, b, 1, False, prec, "none", attention, mask_bytes, stream=act_bytes)
    return (
        (shape.n_layer - shape.n_moe) * memory.layer_activation_bytes(shape, m)
        + shape.n_moe * memory.layer_activation_bytes(shape, m, moe=True)
        + memory.head_activation_bytes(shape, m)
        + memory.embed_activation_bytes(shape, m)
    )
