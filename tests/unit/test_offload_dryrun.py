"""train.activation_offload in the dry run (loom.dryrun): on fake tensors the saved activations are dropped when
packed and made again when the backward unpacks them, as the real hooks free and refill device memory; the dry
run reports the bytes kept in host memory and a lower activation peak. Compared against the same step without
offloading (params, grads and optimizer state unchanged) and against the bytes the real hooks count on a CPU."""

from __future__ import annotations

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
