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
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loom.errors import LoomError
from loom.eval.sampling import sample_next


class Scorer:
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        eot_id: int,
        *,
        batch_size: int = 16,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        lockstep: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """lockstep: a sum over the ranks (Parallelized.all_reduce_sum, or torch.distributed's): the ranks'
        forwards are collectives and must pair up; None: each rank's forwards are its own."""
        self.model, self.device, self.eot_id = model, torch.device(device), eot_id
        self.vocab = model.cfg.vocab_size  # the logits past it are padding (an exported model has none)
        self.batch_size, self.autocast, self.lockstep = batch_size, autocast, lockstep
        # a family whose forward takes `last` (loom's GPT) computes only the logits that are read
        self.tail = "last" in inspect.signature(model.forward).parameters
        self.forwards = 0  # model calls made (real ones): what the tests and the timing report count

    @property
    def block_size(self) -> int:
        return self.model.cfg.block_size

    def _anyone(self, mine: bool) -> bool:
        """Lockstep: does any rank still have a forward to run? (Without lockstep: do I?)"""
        if self.lockstep is None:
            return mine
        return bool(self.lockstep(torch.tensor([int(mine)], device=self.device)).item())

    def _forward(self, idx: torch.Tensor, cache=None, last: int = 0) -> torch.Tensor:
        self.forwards += 1
        with self.autocast():
            if cache is not None:
                return self.model(idx, cache=cache)
            return self.model(idx, last=last) if last and self.tail else self.model(idx)

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
            first = min(len(x) - len(cont) for _, x, cont in batch)  # the earliest position any row reads
            logits = self._forward(inp.to(self.device), last=L - first)
            off = L - logits.size(1)  # the positions before the first computed one
            for j, (i, x, cont) in enumerate(batch):
                n = len(cont)
                lp = F.log_softmax(logits[j, len(x) - n - off : len(x) - off, : self.vocab].float(), dim=-1)
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
        stop text of the batch's `until`; greedy where its temperature is 0. One loop of forwards over all the
        batches, so that in lockstep each forward is agreed on once, whatever batch (or none) a rank is in."""
        self.model.eval()
        g = torch.Generator(device=self.device).manual_seed(seed)
        out: list[list[str]] = []
        todo = iter(range(len(batches)))
        run = None
        while True:
            while run is None or run.finished:
                if run is not None:
                    out.append(run.texts())
                b = next(todo, None)
                if b is None:
                    run = None
                    break
                rows = torch.tensor(batches[b], dtype=torch.long, device=self.device)
                run = _Generation(self, rows, decode, until[b], max_new[b], temperature[b], g)
            if not self._anyone(run is not None):
                return out
            if run is None:
                self._idle()
            else:
                run.step()


class _Generation:
    """One batch being generated: equal-length rows, a KV cache, each row done at end-of-text or a stop text."""

    def __init__(self, scorer: Scorer, idx, decode, until: list[str], max_new: int, temperature: float, g):
        self.scorer, self.idx, self.decode, self.until = scorer, idx, decode, until
        self.max_new, self.temperature, self.g = max_new, temperature, g
        model, B = scorer.model, idx.size(0)
        self.cache = model.kv_cache(B, idx.size(1) + max_new)  # every family's model has one (FamilyModel)
        self.new: list[list[int]] = [[] for _ in range(B)]
        self.done = [False] * B
        self.steps = 0

    @property
    def finished(self) -> bool:
        return all(self.done) or self.steps >= self.max_new

    def step(self) -> None:
        s = self.scorer
        feed = self.idx[:, self.cache.len :] if self.cache is not None else self.idx
        logits = s._forward(feed, self.cache)[:, -1, : s.vocab]
        nxt = sample_next(logits, self.temperature, None, None, self.g if self.temperature > 0 else None)
        self.idx = torch.cat([self.idx, nxt], dim=1)
        self.steps += 1
        for r, t in enumerate(nxt[:, 0].tolist()):
            if self.done[r]:
                continue
            if t == s.eot_id:
                self.done[r] = True
                continue
            self.new[r].append(t)
            if self.until and any(u in self.decode(self.new[r]) for u in self.until):
                self.done[r] = True

    def texts(self) -> list[str]:
        out = []
        for toks in self.new:
            text = self.decode(toks)
            for term in self.until:
                if term:
                    text = text.split(term)[0]
            out.append(text)
        return out
