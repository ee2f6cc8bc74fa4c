"""Scoring continuations and generating with loom's model: what the harness adapter (loom.eval.lm_adapter),
CORE (loom.eval.core) and HellaSwag (loom.eval.hellaswag) all ask of a model, in one place.

  continuations(requests)   (sum of log-probabilities, is-greedy) of each (context ids, continuation ids): the
                            requests sorted by length (longest first) and batched; a right-padded batch is one
                            forward and each row's continuation is read at its own positions (causal attention:
                            the padding after a row never reaches it); log-softmax only over those positions
  generate(requests, ...)   greedy (or sampled) continuations through loom.engine (rows of any length in one
                            running batch), stopping at end-of-text or a stop text

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
        requests: list[tuple[list[int], list[str], int, float]],
        decode: Callable[[list[int]], str],
        seed: int = 1234,
    ) -> list[str]:
        """The text that continues each (context ids, stop texts, max new tokens, temperature) request, cut
        before its first stop text; greedy where its temperature is 0; end-of-text ends it too. The requests
        run through loom.engine, batch_size rows at a time (a row that ends makes room for the next). In
        lockstep each forward is agreed on once, whatever forward (or none) a rank has left."""
        from loom.engine import Engine, Request, SamplingParams, cut_at_stop

        self.model.eval()
        g = torch.Generator(device=self.device).manual_seed(seed)
        longest = max((len(ids) + new for ids, _, new, _ in requests), default=1)
        engine = Engine(
            self.model,
            max_seqs=self.batch_size,
            max_len=max(longest, 1),
            vocab_size=self.vocab,
            decode=decode,
            autocast=self.autocast,
            device=self.device,
        )
        reqs = []
        for ids, until, new, temp in requests:
            if new < 1:  # nothing to generate: the empty text
                reqs.append(None)
                continue
            params = SamplingParams(new, temp, stop_ids=frozenset({self.eot_id}), stop=tuple(until))
            reqs.append(engine.submit(Request(ids, params, g), bounded=False))
        engine.drain(self.lockstep)  # in lockstep: one agreed forward at a time (a rank without one idles)
        self.forwards += engine.forwards
        return [cut_at_stop(decode(r.tokens), r.params.stop) if r else "" for r in reqs]
