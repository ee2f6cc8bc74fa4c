"""train.activation_offload in the dry run (loom.dryrun): on fake tensors the saved activations are dropped when
packed and made again when the backward unpacks them, as the real hooks free and refill device memory; the dry
run reports the bytes kept in host memory and a lower activation peak. Compared against the same step without
offloading (params, grads and optimizer state unchanged) and against the bytes the real hooks count on a CPU."""

from __future__ import annotations

import pytest
import torch

from loom.config import load_config
from loom.dryrun import blocks
from loom.parallel.offload import ActivationOffload

SMALL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=64", "--model.block_size=64"]


def _measure(on: bool):
    cfg = load_config(None, [*SMALL, "--train.batch_size=4", f"--train.activation_offload={str(on).lower()}"])
    return blocks.measure_apart([(cfg, 1, 0, 96, "fp32", None)], 1)[0]


def test_dry_run_counts_offloaded_activations():
    off, on = _measure(False), _measure(True)
    assert off.offloaded == 0 and on.offloaded > 0
    assert (on.params, on.grads, on.optim) == (off.params, off.grads, off.optim)
    assert on.act_peak < off.act_peak, (on.act_peak, off.act_peak)
    print(f"\n[offload dry run] act@peak {off.act_peak} -> {on.act_peak} bytes; {on.offloaded} offloaded")


def test_hooks_count_saved_activations_and_leave_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    hooks = ActivationOffload(torch.device("cpu"))
    with hooks():
        y = torch.relu(lin(x)).sum()
    y.backward()
    # addmm saves its input (4x8); relu saves its output (4x8); the weight is a parameter: left alone
    assert hooks.reset() == 2 * 4 * 8 * 4 and hooks.saved_bytes == 0
    off = ActivationOffload(torch.device("cpu"), enabled=False)
    with off():
        torch.relu(lin(x)).sum().backward()
    assert off.saved_bytes == 0


def test_plan_counts_offload_and_shows_host_memory(capsys):
    """`loom plan --activation-offload`: the same layout keeps its model states, holds fewer activations on the
    GPU, needs host memory for them, and the copies cost time."""
    from loom.cli import main
    from loom.plan.report import build_parser, run_plan

    args = ["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80", "--seq-len", "1024"]
    plain = run_plan(build_parser().parse_args(args))[3]
    moved = run_plan(build_parser().parse_args([*args, "--activation-offload"]))[3]
    key = ("dp", "tp", "pp", "zero", "replicate", "micro_batch", "activation_checkpointing")
    same = {tuple(getattr(c, k) for k in key): c for c in moved}
    for c in plain[:20]:
        o = same[tuple(getattr(c, k) for k in key)]
        assert "host" not in c.memory_gb and o.memory_gb["host"] > 0
        for k in ("params", "grads", "optim", "buffers"):
            assert o.memory_gb[k] == c.memory_gb[k], k
        assert o.memory_gb["activations"] < c.memory_gb["activations"]
        assert o.step_time_s > c.step_time_s  # the copies run on the compute stream
    assert main(["plan", *args, "--activation-offload", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "host GB" in out and "act is what stays on the GPU" in out


def test_plan_with_offload_equals_the_dry_run():
    """The planner's peak with train.activation_offload against the dry run's (fake tensors, the real hooks'
    frees and refills) on a layout where the planner is exact without it: within 2 %, and below the peak
    without offload. The host figure counts each saved tensor once; the hooks copy a tensor as often as autograd
    saves it (q, k and v each save the block's input), so the dry run's offloaded bytes are higher."""
    from loom.dryrun.layout import Target
    from loom.dryrun.report import dry_run

    flags = [
        "--model.family=llama",
        "--model.n_layer=2",
        "--model.n_head=8",
        "--model.n_kv_head=2",
        "--model.n_embd=1024",
        "--model.ffn_hidden=2816",
        "--model.block_size=512",
        "--model.vocab_size=8000",
        "--precision.dtype=bf16",
        "--train.batch_size=8",
        "--train.micro_batch_size=2",
        "--parallel.dp_impl=fsdp",
    ]
    peaks = {}
    for on in (False, True):
        cfg = load_config(None, [*flags, f"--train.activation_offload={str(on).lower()}"])
        result = dry_run(cfg, Target(4), advise=False)
        worst = max(result.ranks, key=lambda r: r.peak)
        assert result.planner["total"] == pytest.approx(worst.peak, rel=0.02), on
        peaks[on] = result.planner["total"]
        if on:
            assert 0 < result.planner["host"] <= worst.offloaded
    assert peaks[True] < 0.85 * peaks[False]
