"""Speculative decoding for loom.engine's greedy rows: something cheap drafts the next k tokens, the model checks
them all in one forward (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023), and a row keeps the drafted tokens its own greedy picks agree with plus the pick after them.
Every kept token is the model's argmax at its place, so the answer is the one decoding token by token gives
(Engine._verify); a good draft makes one forward yield several tokens.

Two drafters, one interface (attach, prefilled, propose):
  NgramProposer  prompt lookup (Saxena 2023; vLLM's `ngram` method): the tokens that followed the most recent
                 earlier occurrence of the context's last n tokens (n from max_ngram down to 1). Free; it pays
                 where answers repeat their context (summaries, code edits, extraction).
  DraftProposer  a smaller run with the same tokenizer (`--draft RUN`), greedy, with a row cache of its own.
                 It keeps up with each row by feeding the row's two newest tokens from two before its end
                 (what it cached of the rejected drafts past that is overwritten), then k - 1 tokens more.

Sampled rows (temperature > 0) and rows under a grammar decode as before: speculation is greedy only here
(rejection sampling, which keeps a sampled row's distribution, is left for later).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import numpy as np
import torch

from loom.engine.request import Request
from loom.engine.sampling import greedy
from loom.model.mtp import mtp_depth


class Speculator(Protocol):
    def attach(self, engine) -> None:  # (a loom.engine.Engine: not imported, it imports this module)
        """Called once by the engine that uses it (its slots and their length)."""

    def prefilled(self, rows: list[Request]) -> None:
        """New rows' prompts are in the engine's cache (their first token is being sampled)."""

    def propose(self, rows: list[Request], k: int) -> list[list[int]]:
        """Up to k drafted tokens after each row's context (fewer, or none, where it has no guess)."""


class NgramProposer:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def attach(self, engine) -> None:  # (a loom.engine.Engine: not imported, it imports this module)
        pass

    def prefilled(self, rows: list[Request]) -> None:
        pass

    def propose(self, rows: list[Request], k: int) -> list[list[int]]:
        return [lookup(r.context(), k, self.max_ngram, self.min_ngram) for r in rows]


def lookup(ctx: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of ctx's last n tokens, the longest n first."""
    if k <= 0 or len(ctx) < 2:
        return []
    arr = np.asarray(ctx)
    for n in range(min(max_ngram, len(ctx) - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every earlier n-gram (not the last)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            at = int(hits[-1]) + n
            return ctx[at : at + k]
    return []


class DraftProposer:
    def __init__(self, model: torch.nn.Module):
        self.model = model.eval()
        self.cache = None
        self.autocast: contextlib.AbstractContextManager | object = contextlib.nullcontext
        self.vocab = model.cfg.vocab_size

    def attach(self, engine) -> None:  # (a loom.engine.Engine: not imported, it imports this module)
        if self.model.cfg.block_size < min(engine.cache_len, engine.block):
            raise ValueError(
                f"the draft model's block_size {self.model.cfg.block_size} is shorter than the rows it would "
                f"draft for ({min(engine.cache_len, engine.block)} tokens)"
            )
        self.cache = self.model.kv_cache(engine.max_seqs, engine.cache_len, rows=True)
        self.autocast, self.vocab, self.device = engine.autocast, engine.vocab, engine.device

    def _forward(self, ids: list[list[int]]) -> torch.Tensor:
        with torch.no_grad(), self.autocast():
            out = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), cache=self.cache)
        return out[:, -1, : self.vocab].float()

    def prefilled(self, rows: list[Request]) -> None:
        """The draft's cache of the new rows' prompts (right-padded, from position 0 of their slots)."""
        L = max(len(r.prompt) for r in rows)
        self.cache.select([r.slot for r in rows])
        for r in rows:
            self.cache.set_len(r.slot, 0)
        with torch.no_grad(), self.autocast():
            ids = torch.tensor([r.prompt + [0] * (L - len(r.prompt)) for r in rows], device=self.device)
            self.model(ids, cache=self.cache)
        for r in rows:
            self.cache.set_len(r.slot, len(r.prompt))

    def propose(self, rows: list[Request], k: int) -> list[list[int]]:
        """Its cache holds each row's context but its last token or more: refeed the newest two (a context
        has at least two once a row decodes: its prompt and its first token), then draft greedily."""
        for r in rows:
            self.cache.set_len(r.slot, len(r.prompt) + len(r.tokens) - 2)
        self.cache.select([r.slot for r in rows])
        nxt = greedy(self._forward([r.context()[-2:] for r in rows])).tolist()
        drafts = [[t] for t in nxt]
        for _ in range(k - 1):
            nxt = greedy(self._forward([[t] for t in nxt])).tolist()
            for d, t in zip(drafts, nxt, strict=True):
                d.append(t)
        return [d[:k] for d in drafts]


class MTPProposer:
    """Self-speculation from the model's own multi-token-prediction modules (model.mtp_depth, loom.model.mtp):
    module k drafts the token k places past the next one, from the row's context and the drafts before it
    (DeepSeek-V3's modules used as drafters, as its report suggests). `mtp_logits` runs the whole context
    without a cache, once per drafted token: this shows the drafts' acceptance, it is not fast (the modules
    would need a row cache of their own, as DraftProposer's model has)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.depth = mtp_depth(model)
        if self.depth < 1:
            raise ValueError("the model has no multi-token-prediction modules (model.mtp_depth = 0)")
        self.autocast: contextlib.AbstractContextManager | object = contextlib.nullcontext

    def attach(self, engine) -> None:  # (a loom.engine.Engine: not imported, it imports this module)
        self.autocast, self.vocab, self.device = engine.autocast, engine.vocab, engine.device

    def prefilled(self, rows: list[Request]) -> None:
        pass

    def propose(self, rows: list[Request], k: int) -> list[list[int]]:
        """Row by row (contexts differ in length): up to min(k, depth) drafts. The row's last token is the main
        head's pick, so module 1 at the position before it predicts the token after it, module 2 (given that
        draft) the one after, ..."""
        out = []
        for r in rows:
            ids, drafts = r.context(), []
            for j in range(min(k, self.depth)):
                with torch.no_grad(), self.autocast():
                    x = torch.tensor([ids + drafts], dtype=torch.long, device=self.device)
                    logits = self.model.mtp_logits(x)
                if len(logits) <= j:
                    break
                drafts.append(int(greedy(logits[j][:, -1, : self.vocab].float())[0]))
            out.append(drafts)
        return out
