"""train.activation_offload (issue 48, item 4): the same gradients bit for bit (fp32, CPU) with and without it,
alone, with activation checkpointing, and under FSDP on 2 real processes; and the hooks really see the saved
activations (offloaded_bytes, what a GPU would move to host memory). Compared against the same run without
the key: every step's loss and gradient norm, as floats, equal."""

from __future__ import annotations

import pytest
from faultkit import Proc, records, run_inprocess, train_args

STEPS = 4


def _steps(run):
    return {r["step"]: r for r in records(run) if "loss" in r}


@pytest.mark.parametrize("ac", ["none", "full"])
def test_same_gradients_with_and_without(char_data, tmp_path, ac):
    runs = {}
    for name, on in (("off", "false"), ("on", "true")):
        args = train_args(char_data, tmp_path, name, STEPS, f"--train.activation_offload={on}")
        assert run_inprocess([*args, f"--train.activation_checkpointing={ac}"]) == 0
        runs[name] = _steps(tmp_path / name)
    for s in range(1, STEPS + 1):
        off, on = runs["off"][s], runs["on"][s]
        assert (on["loss"], on["grad_norm"]) == (off["loss"], off["grad_norm"]), s
        assert "offloaded_bytes" not in off
    # the hooks saw every block's saved activations: at least the blocks' inputs (batch x T x C fp32 each)
    assert runs["on"][1]["offloaded_bytes"] >= 2 * 8 * 16 * 32 * 4


def test_same_gradients_under_fsdp_on_two_ranks(char_data, tmp_path):
    for name, on in (("off", "false"), ("on", "true")):
        args = [
            *train_args(char_data, tmp_path, name, STEPS, f"--train.activation_offload={on}"),
            "--parallel.dp_impl=fsdp",
            "--nproc",
            "2",
        ]
        p = Proc(args, tmp_path / f"{name}.out")
        assert p.wait() == 0, p.stderr()[-3000:]
    off, on = _steps(tmp_path / "off"), _steps(tmp_path / "on")
    assert [(r["loss"], r["grad_norm"]) for r in on.values()] == [
        (r["loss"], r["grad_norm"]) for r in off.values()
    ]
    assert all(r["offloaded_bytes"] > 0 for r in on.values())
