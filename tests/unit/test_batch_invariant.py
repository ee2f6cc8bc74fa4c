"""loom.model.batch_invariant: under it the engine's log-probability of every token it samples is the training
forward's bit for bit (fp32, CPU), for both position kinds, with rows of many lengths joining and leaving a
batch smaller than the request count; and its pieces compute what PyTorch's ops compute (attention to 1e-6,
products and elementwise functions to the bit wherever PyTorch's own path gives the same bits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.engine import Engine, Request, SamplingParams
from loom.model.batch_invariant import _attention, batch_invariant
from loom.model.gpt.gpt import GPT, GPTConfig


def _model(pos: str) -> GPT:
    torch.manual_seed(0)
    extra = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2} if pos == "rope" else {}
    return GPT(GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=64, block_size=64, **extra)).eval()


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_sampler_logprobs_equal_the_training_forwards_bit_for_bit(pos):
    m = _model(pos)
    g = torch.Generator().manual_seed(1)
    # prompts of 1 to 31 tokens, 4 rows at a time: decode steps of 1-4 rows, early positions under 16
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 2, 30, 31, 7, 16, 17, 3, 3, 5)]
    with batch_invariant():
        reqs = Engine(m, max_seqs=4).run(
            [Request(p, SamplingParams(12, 1.0, seed=i, logprobs=True)) for i, p in enumerate(prompts)]
        )
        seqs = [r.prompt + r.tokens for r in reqs]
        T = max(map(len, seqs))
        m.train()  # as the trainer runs it (dropout 0)
        logits = m(torch.tensor([s + [0] * (T - len(s)) for s in seqs]))
        m.eval()
    lp = F.log_softmax(logits.detach().float(), -1)
    got = [lp[j, len(r.prompt) - 1 + i, t].item() for j, r in enumerate(reqs) for i, t in enumerate(r.tokens)]
    want = [x for r in reqs for x in r.logprobs]
    assert len(want) > 50 and got == want


@pytest.mark.parametrize("Tq,L", [(1, 1), (1, 9), (5, 5), (20, 20), (3, 40)])
def test_attention_is_scaled_dot_product_attention(Tq, L):
    g = torch.Generator().manual_seed(Tq * 100 + L)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (Tq, L, L))
    if Tq == L:
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(_attention(q, k, v, is_causal=True), want, atol=1e-6, rtol=0)
    seen = torch.rand(2, 1, Tq, L, generator=g) > 0.3
    seen[..., 0] = True  # every query sees a key
    additive = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
    for mask in (seen, additive):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(_attention(q, k, v, attn_mask=mask), want, atol=1e-6, rtol=0)


def test_products_and_functions_keep_their_values_and_their_gradients():
    x = torch.randn(3, 5, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    with batch_invariant():
        y = F.linear(x, w)
        z = F.gelu(y).sum() + torch.cos(y).sum() + F.linear(x[:1, :3], w).sum()
    assert not y._is_view()  # FSDP hooks a module's output: a view of a padded buffer crashed torch
    torch.testing.assert_close(y, F.linear(x, w), atol=1e-6, rtol=0)
    z.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (F.gelu(F.linear(x, w)).sum() + torch.cos(F.linear(x, w)).sum() + F.linear(x[:1, :3], w).sum()).backward()
    torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=0)
    with batch_invariant():  # a row's product is the same alone and among 40 rows
        rows = torch.randn(40, 64)
        assert torch.equal(F.linear(rows[:1], w), F.linear(rows, w)[:1])
        assert torch.equal(torch.exp(rows[:1, :7]), torch.exp(rows)[:1, :7])


def test_sharded_log_softmax_is_log_softmax():
    """The engine's log-softmax as loss_parallel computes it from vocabulary shards: log_softmax's values (the
    bit-for-bit agreement with a tp trainer is tests/distributed/test_rl_layouts.py's)."""
    from loom.parallel.tensor import sharded_log_softmax

    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)) * 4
    x[:, 100:] = torch.finfo(torch.float32).min  # a padded vocabulary's masked ids
    assert torch.equal(sharded_log_softmax(x, 1), F.log_softmax(x, -1))
    for shards in (2, 4):
        torch.testing.assert_close(sharded_log_softmax(x, shards), F.log_softmax(x, -1), atol=1e-6, rtol=1e-6)
