"""Activation checkpointing (loom.parallel.ac) against the same model without it: equal losses and
gradients (dropout on, so the recomputation must replay the RNG), fewer bytes kept for the backward pass."""

from __future__ import annotations

import pytest
import torch

from loom.errors import LoomError
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.model.gpt.gpt_parallel import blocks
from loom.parallel.ac import activation_bytes, apply_ac

CFG = GPTConfig(vocab_size=50, n_layer=3, n_head=4, n_embd=64, block_size=32, dropout=0.1)


def apply_activation_checkpointing(model: GPT, mode: str) -> GPT:
    apply_ac(blocks(model), mode)
    return model


def _run(mode: str):
    torch.manual_seed(0)
    model = apply_activation_checkpointing(GPT(CFG), mode)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (4, 32), generator=g)
    y = torch.randint(0, 50, (4, 32), generator=g)
    torch.manual_seed(2)  # dropout masks
    loss = model(x, y)
    loss.backward()
    return model, loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, (x, y)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_same_loss_and_grads_as_none(mode):
    ref, loss_ref, grads_ref, _ = _run("none")
    model, loss, grads, _ = _run(mode)
    assert loss == loss_ref
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, grads_ref[n], rtol=0, atol=1e-7, msg=n)
    # names are untouched: checkpoints, tensor parallelism and HF export see the same model
    assert list(model.state_dict()) == list(ref.state_dict())


def test_activation_memory_drops():
    sizes = {}
    for mode in ("none", "full", "selective"):
        model, _, _, (x, y) = _run(mode)
        sizes[mode] = activation_bytes(model, x, y)
    assert sizes["none"] > 0
    assert sizes["full"] < 0.35 * sizes["none"], sizes  # only block inputs (and the head) stay
    assert sizes["full"] < sizes["selective"] < 0.9 * sizes["none"], sizes


def test_no_grad_and_generation_paths_unchanged():
    torch.manual_seed(0)
    ref = GPT(CFG).eval()
    torch.manual_seed(0)
    ac = apply_activation_checkpointing(GPT(CFG), "full").eval()
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ac(x), ref(x), rtol=0, atol=0)


def test_bad_mode_and_double_application():
    with pytest.raises(LoomError, match="activation_checkpointing"):
        apply_activation_checkpointing(GPT(CFG), "some")
    model = apply_activation_checkpointing(GPT(CFG), "full")
    with pytest.raises(LoomError, match="already"):
        apply_activation_checkpointing(model, "selective")
