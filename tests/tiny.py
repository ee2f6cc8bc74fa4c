"""The tiny CPU model the tests train, as `loom` command-line flags (a module beside conftest.py, on the tests'
path): one definition, and each test's departures from it written where the test is.

`tiny_args()` is the model most tests train; `tiny_args({"model.block_size": 16, "train.log_every": None})`
changes a key and leaves one out (loom's default then), so a test's own model reads as what it needs that the
common one lacks.
"""

from __future__ import annotations

# 2 layers of width 32: a step takes milliseconds on one CPU thread, the losses still fall within a few steps
BASE = {
    "model.n_layer": 2,
    "model.n_head": 2,
    "model.n_embd": 32,
    "model.block_size": 32,
    "train.batch_size": 8,
    "train.eval_batches": 2,
    "train.sample_every": 0,
    "optim.warmup_steps": 3,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.device": "cpu",
    # fp32, not the default auto (bf16 on a CPU with bf16 units): the tests compare losses and weights exactly
    "precision.dtype": "fp32",
}


def tiny_args(changes: dict[str, object] | None = None) -> list[str]:
    """BASE as `--key=value` flags, with `changes` applied: a value replaces or adds a key, None leaves it
    out. Keys keep BASE's order, added ones follow in the order given."""
    keys = {**BASE, **(changes or {})}
    return [f"--{k}={v}" for k, v in keys.items() if v is not None]


TINY = tiny_args()
