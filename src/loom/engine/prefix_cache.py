"""A prefix cache across requests: the keys and values of prompts' block-aligned prefixes, kept after their
request ends, so a later prompt that starts with the same tokens (a long system prompt, a few-shot preamble, a
conversation's earlier turns) copies them into its row instead of computing them again.

The engine's cache (loom.model.kv_cache.RowCache) is one contiguous tensor per layer, a row per slot, not pages
that rows could point at. So the simplest design that shares the prefill's work is a store beside it: blocks of
`block` tokens, each keyed by the whole prompt prefix it ends (tokens[: (i + 1) * block], a tuple: exact, no
hash collision can hand a row another prompt's keys), holding that block's keys and values of every layer in one
(2 * n_layer, K, block, D) tensor. A new row copies the blocks of its longest cached prefix into its slot (one
copy per layer) and its prefill computes the rest only, from that position; after a prefill the row's blocks not
yet stored are copied out. Copying costs memory bandwidth instead of the prefill's compute, as SGLang's
RadixAttention and vLLM's automatic prefix caching share blocks, without their paged attention.

Bounded by `max_tokens` (the stored blocks' tokens), evicted least recently used: a match touches its blocks
from the last to the first, so a prefix's first blocks outlive its later ones (a later block without its first is
unreachable: evicting first blocks first would strand the rest).

What a cached row computes: its prefix's keys and values come from an earlier forward, its suffix attends to them
through the mask instead of the prefill's causal attention over the whole block. The values are the same
computation; the kernels may add in another order (float32 rounding, as a larger batch does: loom.engine);
under batch_invariant() they are the same bit for bit (tests/unit/test_prefix_cache.py).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from loom.model.kv_cache import RowCache


class PrefixCache:
    def __init__(self, max_tokens: int, block: int = 16):
        """max_tokens: the most prompt tokens whose keys and values are kept (beside the running rows' cache;
        under one block: none); block: tokens per stored block (a prefix is reused in whole blocks)."""
        self.max_tokens, self.block = max_tokens, block
        self.blocks: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.hits = self.lookups = self.reused = 0  # counts: the tests, /metrics and the bench read them

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block

    def _keys(self, prompt: list[int], n_blocks: int) -> list[tuple[int, ...]]:
        return [tuple(prompt[: (i + 1) * self.block]) for i in range(n_blocks)]

    def match(self, prompt: list[int]) -> list[torch.Tensor]:
        """The stored blocks of the longest block-aligned prefix of `prompt` that leaves at least its last token
        to compute (its logits give the first answer token), first block first; touched as recently used."""
        self.lookups += 1
        found: list[tuple[tuple[int, ...], torch.Tensor]] = []
        for key in self._keys(prompt, (len(prompt) - 1) // self.block):
            kv = self.blocks.get(key)
            if kv is None:
                break
            found.append((key, kv))
        for key, _ in reversed(found):  # the first block most recent: evicted last
            self.blocks.move_to_end(key)
        if found:
            self.hits += 1
            self.reused += len(found) * self.block
        return [kv for _, kv in found]

    def load(self, cache: RowCache, slot: int, blocks: list[torch.Tensor]) -> int:
        """Copy matched blocks into `slot` of the running cache from position 0; its length is set to theirs."""
        n = len(blocks) * self.block
        kv = torch.cat(blocks, dim=2) if len(blocks) > 1 else blocks[0]
        layers = cache.k.t + cache.v.t
        for i, t in enumerate(layers):
            t[slot, :, :n] = kv[i]
        cache.set_len(slot, n)
        return n

    def store(self, cache: RowCache, slot: int, prompt: list[int]) -> None:
        """Keep the whole blocks of `prompt` (its keys and values in `slot`) that are not stored yet."""
        layers = cache.k.t + cache.v.t
        if any(t is None for t in layers):
            return  # (no forward has made the cache's tensors yet)
        keys = self._keys(prompt, len(prompt) // self.block)
        for i, key in enumerate(keys):
            if key not in self.blocks:
                a, b = i * self.block, (i + 1) * self.block
                self.blocks[key] = torch.stack([t[slot, :, a:b] for t in layers])
        for key in reversed(keys):  # the first block most recent, as match() leaves it
            self.blocks.move_to_end(key)
        while self.tokens > self.max_tokens:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()
