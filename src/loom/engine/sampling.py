"""Tokens drawn from a model's logits: temperature, top-k, top-p (nucleus), seeded.

loom.engine draws every row's token with `sample_rows`: the rows that share settings in one vectorised pass, each
row at a uniform number drawn from its own generator (one per token), by the inverse of its distribution's
cumulative sum. A row's draws depend on its logits and its generator only, never on the rows beside it.

One rule for a temperature so small that the logits divided by it overflow float32 (below ~1e-38 for logits
of a few units; a temperature under float32's smallest number is 0 in the division): that row is taken
greedily, the limit of sampling as the temperature goes to 0 (without it the softmax of infinities is NaN and
the draw lands on the last id). A NaN in the logits is a SamplingError, never a token. Both are read from the
rows' totals the draw computes anyway, so a normal temperature costs nothing more and draws what it drew.
"""

from __future__ import annotations

import torch


class SamplingError(ValueError):
    """The logits hold a NaN (a broken forward): no token can be drawn from them."""


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of `logits` (B, V), (B, 1). temperature 0 is greedy."""
    if temperature <= 0:
        return greedy(logits.float())[:, None]
    u = torch.rand(logits.size(0), generator=generator, device=logits.device)
    return sample_rows(logits, u, temperature, top_k, top_p)[:, None]


def sample_rows(
    logits: torch.Tensor,
    uniforms: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """One token id per row of `logits` (B, V) at temperature > 0: the first token whose cumulative probability
    passes the row's uniform number in [0, 1) (B,). Tokens of probability 0 are never drawn. A row whose
    logits overflow at this temperature is taken greedily; a NaN is a SamplingError (the module's docstring)."""
    raw = logits
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    # float64 sums: the last of 50k float32 probabilities is exact to 1e-12, not 1e-5
    cum = logits.softmax(-1).double().cumsum(-1)
    at = uniforms.to(cum.dtype)[:, None] * cum[:, -1:]
    picks = torch.searchsorted(cum, at, right=True)[:, 0].clamp_(max=logits.size(-1) - 1)
    lost = cum[:, -1].isnan()  # a row whose softmax is NaN: its scaled logits overflowed, or it held a NaN
    if bool(lost.any()):
        picks = torch.where(lost, greedy(raw), picks)
    return picks


def constrain(rows: list, logits: torch.Tensor) -> torch.Tensor:
    """`logits` (B, V) with each constrained row's disallowed tokens at -inf (its request's `constraint`: a
    grammar, loom.serve.grammar), the rows in `rows` order; the same tensor, untouched, when no row has one (an
    unconstrained batch samples what it sampled before)."""
    masked = [(j, r.constraint.mask(r.tokens)) for j, r in enumerate(rows) if r.constraint is not None]
    if not masked:
        return logits
    logits = logits.clone()
    for j, allowed in masked:
        logits[j, : allowed.numel()].masked_fill_(~allowed.to(logits.device), float("-inf"))
        logits[j, allowed.numel() :] = float("-inf")  # past the tokenizer's vocabulary: padding
    return logits


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row of `logits` (B, V): SamplingError for a row that holds a NaN."""
    picks = first_max(logits)
    if bool(logits.gather(1, picks[:, None]).isnan().any()):  # argmax ranks NaN above all: one is there
        rows = logits.isnan().any(-1).nonzero()[:, 0].tolist()
        raise SamplingError(f"the logits of row(s) {rows} hold NaN: no token can be drawn (a broken forward)")
    return picks


BLOCK = 128  # first_max's block: the maxima of (B, V / 128) blocks, then one block per row


def first_max(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of (B, V) (the first maximum, NaN above all), in two short passes on a CPU: torch's
    CPU argmax is not vectorised (0.9 ms for 16 x 50k logits, 7x its max), a step of GPT-2 decoding."""
    B, V = logits.shape
    head = V - V % BLOCK
    if logits.device.type != "cpu" or head < 2 * BLOCK:
        return logits.argmax(dim=-1)
    blocks = logits[:, :head].reshape(B, head // BLOCK, BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # the first block holding the row's maximum
    rows = torch.arange(B, device=logits.device)
    picks = best * BLOCK + blocks[rows, best].argmax(dim=-1)
    if head == V:
        return picks
    tail = logits[:, head:]
    top, at = tail.max(dim=-1)
    here = logits[rows, picks]
    # the tail wins only with a larger value, or the row's first NaN
    later = (top > here) | (top.isnan() & ~here.isnan())
    return torch.where(later, head + at, picks)
