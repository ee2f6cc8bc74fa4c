"""Scoring continuations and generating with loom's model: what the harness adapter (loom.eval.lm_adapter),
CORE (loom.eval.core) and HellaSwag (loom.eval.hellaswag) all ask of a model, in one place.

  continuations(requests)   (sum of log-probabilities, is-greedy) of each (context ids, continuation ids): the
                            requests sorted by length (longest first) and batched; a right-padded batch is one
                            forward and each row's continuation is read at its own positions (causal attention:
                            the padding after a row never reaches it); log-softmax only over those positions
  generate(rows, ...)       greedy (or sampled) continuation of equal-length rows with the KV cache, stopping at
                            end-of-text or a stop text

Lockstep (an FSDP-sharded model: every forward is a collective): before each forward the ranks agree, with one
all-reduce, whether anyone still has work, and a rank with none runs a one-token forward that only keeps the
others company. So ranks holding different numbers of requests (or generating different lengths) stay in step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loom.errors import LoomError


class Scorer:
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        eot_id: int,
        vocab_size: int,
        *,
        batch_size: int = 16,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        lockstep: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """lockstep: a sum over the ranks (Parallelized.all_reduce_sum, or torch.distributed's): the ranks'
        forwards are collectives and must pair up; None: each rank's forwards are its own."""
        self.model, self.device, self.eot_id, self.vocab = model, torch.device(device), eot_id, vocab_size
        self.batch_size, self.autocast, self.lockstep = batch_size, autocast, lockstep
        self.forwards = 0  # model calls made (real ones): what the tests and the timing report count

    @property
    def block_size(self) -> int:
        return self.model.cfg.block_size

    def _anyone(self, mine: bool) -> bool:
        """Lockstep: does any rank still have a forward to run? (Without lockstep: do I?)"""
        if self.lockstep is None:
            return mine
        return bool(self.lockstep(torch.tensor([int(mine)], device=self.device)).item())

    def _forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        self.forwards += 1
        with self.autocast():
            return self.model(idx, cache=cache) if cache is not None else self.model(idx)

    def _idle(self) -> None:
        """Lockstep: the forward a rank without work runs so the sharded forwards of the others complete."""
        with self.autocast():
            self.model(torch.full((1, 1), self.eot_id, dtype=torch.long, device=self.device))

    @torch.no_grad()
    def continuations(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation, is it the greedy continuation) per (context,
        continuation) pair of token ids. Too long for the window: the context loses tokens on the left (and a
        continuation longer than the window is scored on its last block_size tokens), as the harness's hf does."""
        self.model.eval()
        T = self.block_size
        rows = []
        for i, (ctx, cont) in enumerate(requests):
            if not ctx or not cont:
                raise LoomError("a scoring request needs a context and a continuation of at least one token")
            whole = (ctx + cont)[-(T + 1) :]
            rows.append((i, whole[:-1], cont[-T:]))
        rows.sort(key=lambda r: (-len(r[1]), r[1]))  # longest first, equal inputs side by side
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        batches = [rows[k : k + self.batch_size] for k in range(0, len(rows), self.batch_size)]
        b = 0
        while self._anyone(b < len(batches)):
            if b >= len(batches):
                self._idle()
                continue
            batch = batches[b]
            b += 1
            L = len(batch[0][1])
            inp = torch.full((len(batch), L), self.eot_id, dtype=torch.long)
            for j, (_, x, _) in enumerate(batch):
                inp[j, : len(x)] = torch.tensor(x)
            logits = self._forward(inp.to(self.device))
            for j, (i, x, cont) in enumerate(batch):
                n = len(cont)
                lp = F.log_softmax(logits[j, len(x) - n : len(x), : self.vocab].float(), dim=-1)
                target = torch.tensor(cont, device=lp.device)
                greedy = bool((lp.argmax(-1) == target).all())
                out[i] = (float(lp.gather(1, target[:, None]).sum()), greedy)
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def generate(
        self,
        batches: list[list[list[int]]],
        decode: Callable[[list[int]], str],
        until: list[list[str]],
        max_new: list[int],
        temperature: list[float],
        seed: int = 1234,
    ) -> list[list[str]]:
        """The texts that continue each batch's rows (each batch: rows of one length), cut before the first
        stop text of the batch's `until`; greedy where its temperature is 0."""
        self.model.eval()
        g = torch.Generator(device=self.device).manual_seed(seed)
        out: list[list[str]] = []
        b = 0
        while self._anyone(b < len(batches)):
            if b >= len(batches):
                self._idle()
                continue
            idx = torch.tensor(batches[b], dtype=torch.long, device=self.device)
            out.append(self._generate(idx, decode, until[b], max_new[b], temperature[b], g))
            b += 1
        return out

    def _generate(self, idx, decode, until: list[str], max_new: int, temperature: float, g) -> list[str]:
        from loom.generate import sample_next

        B = idx.size(0)
        cache = self.model.kv_cache(B, idx.size(1) + max_new) if hasattr(self.model, "kv_cache") else None
        new: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        step = 0
        while self._anyone(not all(done) and step < max_new):
            if all(done) or step >= max_new:
                self._idle()
                continue
            feed = idx[:, cache.len :] if cache is not None else idx
            logits = self._forward(feed, cache)[:, -1, : self.vocab]
            nxt = sample_next(logits, temperature, None, None, g if temperature > 0 else None)
            idx = torch.cat([idx, nxt], dim=1)
            step += 1
            for r in range(B):
                if done[r]:
                    continue
                t = int(nxt[r])
                if t == self.eot_id:
                    done[r] = True
                    continue
                new[r].append(t)
                if until and any(s in decode(new[r]) for s in until):
                    done[r] = True
        texts = []
        for toks in new:
            s = decode(toks)
            for term in until:
                if term:
                    s = s.split(term)[0]
            texts.append(s)
        return texts
