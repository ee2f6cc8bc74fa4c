"""Sampling with a KV cache: temperature, top-k, top-p (nucleus), seeded.

With the cache, the prompt is run once (prefill) and each new token costs one position. The cache holds the
key/value heads only (grouped-query attention shares them when attention runs) and, with RoPE, keys already
rotated by their positions. Once the sequence outgrows block_size the context is re-cropped and recomputed
every step, exactly as cache-free generation does (learned positions shift; the cache has block_size slots),
so the result is the same either way.
"""

from __future__ import annotations

import torch

from loom.model.gpt import GPT, KVCache


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of `logits` (B, V). temperature 0 is greedy."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Extend `idx` (B, T) by max_new_tokens sampled tokens. Padding ids >= vocab_size are never sampled."""
    was_training = model.training
    model.eval()
    block = model.cfg.block_size
    vocab = vocab_size or model.cfg.vocab_size
    cache = None
    if use_cache:
        p = next(model.parameters())
        cache = KVCache(model.cfg, idx.size(0), block, p.device, p.dtype)
    try:
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= block:
                # Feed only what the cache has not seen yet (the whole prompt the first time).
                logits = model(idx[:, cache.len :], cache=cache)
            else:  # no cache, or beyond block_size where positions shift: recompute the cropped context
                logits = model(idx[:, -block:])
            logits = logits[:, -1, :vocab]
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            idx = torch.cat([idx, nxt], dim=1)
    finally:
        model.train(was_training)
    return idx
