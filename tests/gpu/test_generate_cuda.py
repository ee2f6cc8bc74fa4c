"""KV-cache generation on a CUDA GPU equals cache-free generation (a full forward over the whole context
each token), greedy, in fp32 with TF32 off; and the cached logits of each new position equal a full
forward's to fp32 rounding. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from loom.generate import generate
from loom.model.gpt.gpt import GPT, GPTConfig, KVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def model():
    before = torch.backends.cuda.matmul.allow_tf32  # a module-like object: monkeypatch cannot restore it
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    yield GPT(GPTConfig(vocab_size=97, n_layer=2, n_head=4, n_embd=64, block_size=48)).cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = before


def test_cached_generation_equals_full_forward(model):
    prompt = torch.randint(0, 97, (3, 5), device="cuda")
    cached = generate(model, prompt, 40, temperature=0.0, use_cache=True)
    full = generate(model, prompt, 40, temperature=0.0, use_cache=False)
    assert cached.device.type == "cuda"
    assert torch.equal(cached, full)
    # beyond block_size (48) the context is re-cropped and recomputed, as without the cache
    assert torch.equal(
        generate(model, prompt, 60, temperature=0.0), generate(model, prompt, 60, 0.0, use_cache=False)
    )


@torch.no_grad()
def test_cached_logits_equal_a_full_forward(model):
    idx = torch.randint(0, 97, (2, 30), device="cuda")
    full = model(idx)
    cache = KVCache(model.cfg, 2, model.cfg.block_size, idx.device, torch.float32)
    steps = [model(idx[:, :10], cache=cache)] + [model(idx[:, t : t + 1], cache=cache) for t in range(10, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)
