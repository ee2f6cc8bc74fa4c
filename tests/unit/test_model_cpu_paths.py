"""The model's CPU fast paths against PyTorch's reference ops: written-out bf16 attention (CPU autocast)
against F.scaled_dot_product_attention in fp32, loom's Dropout against F.dropout's distribution, and the
exact-GELU option against nn.GELU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.model.gpt.gpt import GPT, MLP, Dropout, GPTConfig, causal_attention


def _qkv(B=2, H=4, T=48, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # (B, T, H, D) transposed to (B, H, T, D), as the model lays them out
    return [torch.randn(B, T, H, D, generator=g).transpose(1, 2).requires_grad_() for _ in range(3)]


def test_bf16_attention_matches_fp32_sdpa():
    q, k, v = _qkv()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = causal_attention(q, k, v, 0.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    # causal: the first query sees only the first key
    torch.testing.assert_close(out[:, :, 0].float(), v[:, :, 0].detach(), atol=2e-2, rtol=2e-2)


def test_fp32_attention_is_sdpa_itself():
    q, k, v = _qkv()
    assert torch.equal(
        causal_attention(q, k, v, 0.0), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    )


def test_bf16_attention_dropout_is_unbiased():
    q, k, v = _qkv(B=1, H=2, T=16, D=8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        clean = causal_attention(q, k, v, 0.0).float()
        torch.manual_seed(0)
        mean = sum(causal_attention(q, k, v, 0.3).float() for _ in range(400)) / 400
    assert (mean - clean).abs().mean() < 0.03


def test_dropout_distribution_and_eval_mode():
    drop = Dropout(0.25)
    x = torch.ones(400, 500)
    torch.manual_seed(0)
    y = drop(x)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.005
    assert torch.all(y[kept] == 1 / 0.75)
    assert torch.equal(drop.eval()(x), x)
    assert torch.equal(Dropout(1.0)(x), torch.zeros_like(x))  # as nn.Dropout(p=1)
    assert isinstance(drop, torch.nn.Dropout)  # module type and state_dict as torch's


def test_dropout_is_reproducible_from_the_seed():
    drop = Dropout(0.5)
    torch.manual_seed(3)
    a = drop(torch.ones(64, 64))
    torch.manual_seed(3)
    assert torch.equal(drop(torch.ones(64, 64)), a)


@pytest.mark.parametrize(
    "activation,module", [("gelu", torch.nn.GELU()), ("gelu_tanh", torch.nn.GELU("tanh"))]
)
def test_mlp_activation(activation, module):
    cfg = GPTConfig(vocab_size=16, n_embd=8, activation=activation)
    mlp = MLP(cfg)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(mlp(x), mlp.down_proj(module(mlp.up_proj(x))))
    # same parameter names whatever the activation (checkpoints, TP plans, HF export)
    assert [n for n, _ in GPT(cfg).named_parameters()] == [
        n for n, _ in GPT(GPTConfig(16, n_embd=8)).named_parameters()
    ]


def test_inference_layout_moves_the_weights_and_keeps_the_numbers(tmp_path):
    """Linear weights stored transposed: the same tensors (values, shapes, state dict), the head tied to the
    embedding given a copy of its own (the embedding's lookups stay contiguous), the logits equal, and the
    engine's greedy tokens the same."""
    from loom.engine import Engine, Request, SamplingParams
    from loom.model.cpu_paths import inference_layout

    torch.manual_seed(0)
    m = GPT(
        GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=64, block_size=64, tie_embeddings=True)
    ).eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randint(0, 97, (16, 12))
    with torch.no_grad():
        ref = m(x)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    tokens = [r.tokens for r in Engine(m, max_seqs=16).run([Request(row, greedy) for row in x.tolist()])]
    linears = [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]
    assert inference_layout(m) == len(linears) == 2 * 6 + 1
    assert all(not mod.weight.is_contiguous() and mod.weight.t().is_contiguous() for mod in linears)
    assert m.lm_head.weight is not m.wte.weight and m.wte.weight.is_contiguous()
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref, atol=1e-5, rtol=0)
    assert [
        r.tokens for r in Engine(m, max_seqs=16).run([Request(row, greedy) for row in x.tolist()])
    ] == tokens
    assert inference_layout(m) == 0  # moved already
