"""The GPT against its own definitions: parameter/FLOP formulas, initial loss ~ ln(V), weight tying, and the
KV cache against cache-free computation (logits and seeded generation must be equal)."""

import math

import pytest
import torch

from loom.generate import generate, sample_next
from loom.model.flops import flops_per_token, matmul_params, param_count
from loom.model.gpt.gpt import GPT, GPTConfig, KVCache


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(
        GPTConfig(**{"vocab_size": 70, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, **kw})
    )


@pytest.mark.parametrize("bias", [False, True])
def test_param_count_formula_matches_module(bias):
    m = tiny(bias=bias)
    assert m.num_params() == param_count(m.cfg)


def test_vocab_padded_to_64_and_head_tied():
    m = tiny()
    assert m.cfg.padded_vocab == 128 and m.wte.weight.shape == (128, 32)
    assert m.lm_head.weight.data_ptr() == m.wte.weight.data_ptr()


def test_flops_per_token_counts_head_and_attention():
    cfg = GPTConfig(vocab_size=50257, n_layer=12, n_head=12, n_embd=768, block_size=1024)
    # GPT-2 small: 85M in blocks + 38.6M head; 6N + 12*L*C*T
    assert matmul_params(cfg) == 12 * 12 * 768**2 + 50304 * 768
    assert flops_per_token(cfg) == 6 * matmul_params(cfg) + 12 * 12 * 768 * 1024


def test_initial_loss_is_uniform():
    m = tiny()
    x = torch.randint(0, 70, (4, 16))
    loss = m(x, x)
    assert abs(loss.item() - math.log(70)) < 0.6  # GPT-2 init: near-uniform over the 70 real ids


def test_residual_projections_scaled_init():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=64, n_layer=8, n_head=2, n_embd=256, block_size=8))
    std_o = m.blocks[0].attn.o_proj.weight.std().item()
    std_q = m.blocks[0].attn.q_proj.weight.std().item()
    assert abs(std_q - 0.02) < 0.002
    assert abs(std_o - 0.02 / math.sqrt(16)) < 0.001


def test_kv_cache_logits_equal_full_forward():
    m = tiny().eval()
    x = torch.randint(0, 70, (2, 12))
    full = m(x)
    cache = KVCache(m.cfg, 2, 16, "cpu", torch.float32)
    parts = [m(x[:, :5], cache=cache)] + [m(x[:, i : i + 1], cache=cache) for i in range(5, 9)]
    parts.append(m(x[:, 9:], cache=cache))  # a multi-token block onto a non-empty cache
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k,top_p", [(None, None), (5, None), (None, 0.9)])
def test_generation_with_cache_equals_cache_free(top_k, top_p):
    m = tiny()
    prompt = torch.randint(0, 70, (2, 3))
    outs = []
    for use_cache in (True, False):
        g = torch.Generator().manual_seed(7)
        # 30 new tokens: crosses block_size (16), where the cached path must re-crop like the cache-free one
        outs.append(generate(m, prompt, 30, 1.0, top_k, top_p, g, use_cache=use_cache, vocab_size=70))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape == (2, 33) and outs[0].max() < 70


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=0).item() == 3
    draws = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(50)}
    assert draws == {2, 3}
    draws = {sample_next(logits * 10, 1.0, top_p=0.5, generator=g).item() for _ in range(20)}
    assert draws == {3}


def test_sequence_longer_than_block_is_refused():
    m = tiny()
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 17, dtype=torch.long))
