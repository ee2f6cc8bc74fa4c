"""The padded vocabulary: embeddings and heads are rounded up to a multiple of 64 rows, and the padding ids'
logits are masked wherever logits are made (GPT's head, its tensor-parallel shards, parallel/fp8's float8 head)."""

from __future__ import annotations

import torch


def mask_padding_(logits: torch.Tensor, vocab_size: int, offset: int = 0) -> torch.Tensor:
    """Set the logits of padding ids (>= vocab_size) to their dtype's lowest value, in place, and return them.

    `logits` (..., V_local) holds the ids offset .. offset + V_local - 1 (a vocabulary-parallel shard starts at
    its rank's offset). exp(lowest - max) is 0 in every float type, so padding ids take no probability in
    the loss, in sampling or in evaluation, and no gradient reaches their rows; a finite value rather than
    -inf keeps p * log p at 0 where something computes an entropy."""
    start = max(vocab_size - offset, 0)
    if start < logits.size(-1):
        logits.narrow(-1, start, logits.size(-1) - start).fill_(torch.finfo(logits.dtype).min)
    return logits
