"""The engine: a running batch of requests over one RowCache, stepped until every request is done.

A step first admits waiting requests into free slots (while the slots and the KV-token budget allow), then runs
its forwards: the new rows' prompts (prefill, right-padded, in groups of similar length), one token for every
row already cached (decode), and full forwards for rows past the cache (recompute). Rows that share a prompt
(an RL group, a request's n answers) are prefilled once, the others copying its cache rows. Each forward's last logits
give each of its rows one token, sampled with the row's own settings; a row that ends leaves its slot at once.
`plan()` lists a step's forwards without running them, so ranks that must pair their forwards (an FSDP-sharded
model: loom.eval.scoring) can run them one at a time.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.nn.functional as F

from loom.engine.prefix_cache import PrefixCache
from loom.engine.request import CANCELLED, LENGTH, STOP, Request
from loom.engine.sampling import constrain, greedy, sample_rows
from loom.engine.speculative import Speculator
from loom.parallel.tensor import sharded_log_softmax, vocab_shards, whole


class QueueFull(Exception):
    """The waiting queue holds max_queue requests already (a server answers 429)."""


# what torch.Generator.manual_seed takes (a negative seed is seed mod 2**64)
SEED_RANGE = (-(2**63), 2**64 - 1)


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_seqs: int = 16,
        max_len: int | None = None,
        max_kv_tokens: int | None = None,
        max_queue: int | None = None,
        vocab_size: int | None = None,
        decode: Callable[[list[int]], str] | None = None,
        extends_context: bool = False,
        use_cache: bool = True,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        max_prefill_tokens: int = 4096,
        device: torch.device | None = None,
        fail_alone: bool = False,
        prefix_cache_tokens: int = 0,
        speculator: Speculator | None = None,
        spec_tokens: int = 4,
    ):
        """max_seqs rows run at once, each of up to max_len tokens (default: block_size; a family that runs on
        past it, extends_context, may take more); max_kv_tokens bounds the tokens the running rows may reach
        together (each row reserves prompt + max_tokens when it joins); max_queue bounds the waiting requests
        (None: unbounded); vocab_size: ids past it are padding, never sampled; decode: token ids to text, for
        stop texts. use_cache False: every token recomputes its whole context (a reference, slow). fail_alone
        (a server's engine): an error in one row's own bookkeeping (its stop text's decoding, its callback)
        fails that row alone (its `error`), the others go on; else it is raised to the caller.
        prefix_cache_tokens > 0: prompts' block-aligned prefixes are kept across requests, up to that many tokens
        (loom.engine.prefix_cache); 0: off. speculator (loom.engine.speculative): greedy rows decode by
        speculation, up to spec_tokens drafted tokens verified in one forward."""
        self.model, self.decode, self.autocast = model, decode, autocast
        cfg = model.cfg
        self.block, self.extends = cfg.block_size, extends_context and use_cache
        self.max_len = max_len or self.block
        self.vocab = vocab_size or cfg.vocab_size
        self.device = device or next(model.parameters()).device
        # speculation verifies up to spec_tokens positions past a row's length: room for them in every slot
        self.speculator = speculator if use_cache else None
        self.spec_tokens = spec_tokens if self.speculator is not None else 0
        self.cache_len = self.max_len + self.spec_tokens
        self.cache = model.kv_cache(max_seqs, self.cache_len, rows=True) if use_cache else None
        self.prefix = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens and use_cache else None
        self._start = [0] * max_seqs  # per slot: the prompt tokens a prefill finds in it (a cached prefix)
        self.max_seqs, self.max_queue = max_seqs, max_queue
        self.max_kv_tokens = max_kv_tokens or max_seqs * self.max_len
        self.max_prefill_tokens = max_prefill_tokens
        self.fail_alone = fail_alone
        self.free = list(range(max_seqs))
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.reserved = 0
        self.tail = "last" in inspect.signature(model.forward).parameters  # logits of the last positions only
        self.vocab_shards = 1  # the last forward's logits: vocabulary shards under tensor parallel
        self.forwards = self.generated = self.prefilled = (
            0  # counts: the tests, /metrics and the bench read them
        )
        # speculation's counts: drafted tokens verified and accepted, verify forwards, rows they verified
        self.spec_proposed = self.spec_accepted = self.spec_forwards = self.spec_rows = 0
        if self.speculator is not None:
            self.speculator.attach(self)

    # ----------------------------------------------------------------------------- requests in and out
    def reserve(self, req: Request) -> int:
        """The KV tokens a request holds while it runs: its prompt and answer, within its slot."""
        return min(len(req.prompt) + req.params.max_tokens, self.max_len)

    def check(self, req: Request) -> None:
        """A request the engine can never run: ValueError (before it queues)."""
        if not req.prompt:
            raise ValueError("a request needs a prompt of at least one token")
        if req.params.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.extends and len(req.prompt) + req.params.max_tokens > self.max_len:
            raise ValueError(f"prompt + max_tokens exceed the engine's {self.max_len} tokens per row")
        if self.reserve(req) > self.max_kv_tokens:
            raise ValueError(f"the request needs {self.reserve(req)} KV tokens, over max_kv_tokens")
        seed = req.params.seed
        if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ValueError(f"seed {seed} is outside [-2**63, 2**64 - 1], the range a generator takes")

    def submit(self, req: Request, bounded: bool = True) -> Request:
        """Queue a request (QueueFull past max_queue when bounded); it joins the running batch at a step."""
        self.check(req)
        if bounded and self.max_queue is not None and len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests wait already")
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request now (a client that left): out of the queue, or out of its slot."""
        if req.done:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish(CANCELLED)
        self._leave(req)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _admit(self) -> None:
        while self.waiting and self.free:
            req = self.waiting[0]
            if self.running and self.reserved + self.reserve(req) > self.max_kv_tokens:
                return  # it waits for rows to finish (first come, first served)
            self.waiting.popleft()
            req.slot = self.free.pop(0)
            self._start[req.slot] = 0
            self.reserved += self.reserve(req)
            req.recompute = self.cache is None or len(req.prompt) > self.max_len
            self.running.append(req)

    def _leave(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.reserved -= self.reserve(req)
            self.free.append(req.slot)
            self.free.sort()  # the lowest slots first: a batch of the first n slots reads the cache as a view
        if req.on_token is not None:
            req.on_token(req)

    # ----------------------------------------------------------------------------- stepping
    def plan(self) -> list[Callable[[], None]]:
        """This step's forwards, each a call that runs one forward and samples its rows' next tokens."""
        self._admit()
        new = [r for r in self.running if not r.prefilled and not r.recompute]
        if self.prefix is not None:
            new = self._reuse_prefixes(new)
        cached = [r for r in self.running if r.prefilled and not r.recompute]
        jobs = [partial(self._prefill, g) for g in self._prefill_groups(new)]
        spec = [r for r in cached if self._speculates(r)]
        plain = [r for r in cached if not self._speculates(r)]
        if plain:
            jobs.append(partial(self._decode, plain))
        if spec:
            jobs.append(partial(self._verify, spec))
        by_len: dict[int, list[Request]] = {}
        for r in self.running:
            if r.recompute:
                by_len.setdefault(min(len(r.context()), self.block), []).append(r)
        jobs += [partial(self._recompute, g) for g in by_len.values()]
        return jobs

    def step(self) -> None:
        for job in self.plan():
            job()

    def run(self, requests: list[Request], lockstep: Callable | None = None) -> list[Request]:
        """Every request through to its end (the queue's bound does not apply: the caller holds them all);
        lockstep as in drain()."""
        for req in requests:
            self.submit(req, bounded=False)
        self.drain(lockstep)
        return requests

    def drain(self, lockstep: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Step until every submitted request is done. lockstep (a sum over the ranks) for a model whose forward
        is a collective over ranks that run engines of their own (FSDP's all-gathers over data-parallel ranks
        sampling different prompts): the ranks agree before each forward whether anyone still has one, and a
        rank without one runs an idle forward, so their collectives pair up."""
        with _eval_mode(self.model):
            if lockstep is None:
                while self.busy:
                    self.step()
                return
            jobs: list = []
            while lockstep(torch.tensor([int(bool(jobs) or self.busy)], device=self.device)).item():
                if not jobs and self.busy:
                    jobs = self.plan()
                if jobs:
                    jobs.pop(0)()
                else:
                    self._idle()

    def stream(self, req: Request) -> Iterator[int]:
        """One request's tokens as they are sampled (stepping the engine; a caller that stops early cancels)."""
        self.submit(req, bounded=False)
        seen = 0
        with _eval_mode(self.model):
            try:
                while not req.done:
                    self.step()
                    yield from req.tokens[seen:]
                    seen = len(req.tokens)
                yield from req.tokens[seen:]
            finally:
                self.cancel(req)

    def _prefill_groups(self, new: list[Request]) -> list[list[Request]]:
        """New rows in groups of similar length (longest first; a row at least half the group's longest, so
        padding at most doubles the work) of at most max_prefill_tokens padded tokens."""
        groups: list[list[Request]] = []
        for r in sorted(new, key=lambda r: -self._fed(r)):
            g = groups[-1] if groups else None
            L = self._fed(g[0]) if g else 0
            if g and 2 * self._fed(r) >= L and (len(g) + 1) * L <= self.max_prefill_tokens:
                g.append(r)
            else:
                groups.append([r])
        return groups

    def _fed(self, r: Request) -> int:
        """The prompt tokens a new row's prefill computes (those past its cached prefix)."""
        return len(r.prompt) - self._start[r.slot]

    def _speculates(self, r: Request) -> bool:
        """A greedy row without a grammar decodes by speculation when the engine has a speculator."""
        return (
            self.speculator is not None
            and r.params.temperature <= 0
            and getattr(r, "constraint", None) is None
        )

    def _reuse_prefixes(self, new: list[Request]) -> list[Request]:
        """The new rows to prefill this step, each with its longest cached prefix copied into its slot. A row
        without one whose first block another such row of this step starts with waits one step: that row's
        prefill stores the blocks they share, and it copies them then (a system prompt that 16 requests bring
        at once is computed once). Rows with the same whole prompt are prefilled together as before."""
        now, leaders = [], {}  # a first block -> the prompt of the row computing it
        for r in new:
            blocks = self.prefix.match(r.prompt)
            if blocks:
                self._start[r.slot] = self.prefix.load(self.cache, r.slot, blocks)
                now.append(r)
                continue
            head, whole = tuple(r.prompt[: self.prefix.block]), tuple(r.prompt)
            if len(r.prompt) > self.prefix.block and leaders.get(head, whole) != whole:
                continue  # it waits for the leader's blocks
            leaders.setdefault(head, whole)
            now.append(r)
        return now

    def _forward(self, ids: torch.Tensor, cache=None, last: int = 0) -> torch.Tensor:
        self.forwards += 1
        with torch.no_grad(), self.autocast():
            if cache is not None:
                out = (
                    self.model(ids, cache=cache, last=last)
                    if last and self.tail
                    else self.model(ids, cache=cache)
                )
            else:
                out = self.model(ids)
        # a tensor-parallel model's logits are vocabulary shards (a DTensor): every rank samples from all of them,
        # and takes log-probabilities as the trainer's vocabulary-parallel loss computes them
        self.vocab_shards = vocab_shards(out)
        return whole(out)

    def _idle(self) -> None:
        """Lockstep: the forward a rank without work runs so the others' sharded forwards complete."""
        with torch.no_grad(), self.autocast():
            self.model(torch.zeros((1, 1), dtype=torch.long, device=self.device))

    def _prefill(self, rows: list[Request]) -> None:
        """The prompts of new rows, right-padded to the longest, from position 0 of their slots. Rows with the
        same prompt (an RL group's samples, a request's n answers) are computed once: the others copy its
        cached keys and values and its last logits."""
        source: dict[tuple, int] = {}  # prompt -> its row in the forward
        unique: list[Request] = []
        for r in rows:
            if source.setdefault(tuple(r.prompt), len(unique)) == len(unique):
                unique.append(r)
        fed = [self._fed(r) for r in unique]  # past a cached prefix (loom.engine.prefix_cache) only
        L, first = max(fed), min(fed)
        ids = torch.zeros(len(unique), L, dtype=torch.long)
        for j, r in enumerate(unique):
            ids[j, : fed[j]] = torch.tensor(r.prompt[self._start[r.slot] :])
        self.cache.select([r.slot for r in unique])
        for r in unique:
            self.cache.set_len(r.slot, self._start[r.slot])
        logits = self._forward(ids.to(self.device), self.cache, last=L - first + 1)
        off = L - logits.size(1)  # positions before the first computed one
        for r in unique:
            self.cache.set_len(r.slot, len(r.prompt))
            if self.prefix is not None:
                self.prefix.store(self.cache, r.slot, r.prompt)
        src, dst = [], []  # a copying row's source slot, and its own
        for r in rows:
            first = unique[source[tuple(r.prompt)]]
            if r is not first:
                src.append(first.slot)
                dst.append(r.slot)
            r.prefilled = True
        self.cache.copy_rows(src, dst)
        self.prefilled += sum(fed)
        last = torch.stack([logits[j, fed[j] - 1 - off] for j in range(len(unique))])
        if self.speculator is not None:
            self.speculator.prefilled(rows)
        self._sample(rows, last[[source[tuple(r.prompt)] for r in rows]])

    def _decode(self, rows: list[Request]) -> None:
        """One token for each cached row, at its own position."""
        ids = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long, device=self.device)
        self.cache.select([r.slot for r in rows])
        logits = self._forward(ids, self.cache)
        self._sample(rows, logits[:, -1])

    def _verify(self, rows: list[Request]) -> None:
        """Greedy rows by speculation (loom.engine.speculative): each row's last token and up to k drafted ones
        in one forward at its own positions; a row keeps the drafted tokens the model's own greedy picks agree
        with, and the pick after them, so its tokens are those decoding one at a time gives (up to the kernels'
        float rounding on k + 1 positions instead of 1). The keys of rejected drafts lie past the row's length,
        never seen, and its next forward overwrites them."""
        cap = self.cache_len if self.extends else min(self.cache_len, self.block)
        k = min(self.spec_tokens, min(cap - len(r.prompt) - len(r.tokens) for r in rows))
        drafts = self.speculator.propose(rows, k)  # (also when k is 0: a draft model keeps up with the rows)
        ids = [[r.tokens[-1], *d, *[0] * (k - len(d))] for r, d in zip(rows, drafts, strict=True)]
        self.cache.select([r.slot for r in rows])
        logits = self._forward(torch.tensor(ids, dtype=torch.long, device=self.device), self.cache)
        self.spec_forwards += 1
        self.spec_rows += len(rows)
        padded = logits.float()
        logits = padded[:, :, : self.vocab]
        picks = greedy(logits.reshape(-1, logits.size(-1))).view(len(rows), k + 1).tolist()
        want = any(r.params.logprobs or r.params.top_logprobs for r in rows)
        for j, (r, d) in enumerate(zip(rows, drafts, strict=True)):
            a = 0
            while a < len(d) and d[a] == picks[j][a]:
                a += 1
            self.spec_proposed += len(d)
            self.spec_accepted += a
            # its cache holds its last token and the accepted drafts; the next forward starts past them
            self.cache.set_len(r.slot, len(r.prompt) + len(r.tokens) + a)
            logp = None
            if want:
                logp = (
                    sharded_log_softmax(padded[j], self.vocab_shards)[:, : self.vocab]
                    if self.vocab_shards > 1
                    else F.log_softmax(logits[j], dim=-1)
                )
            try:
                for i in range(a + 1):
                    lp = None if logp is None else float(logp[i, picks[j][i]])
                    self._append(r, picks[j][i], lp, None if logp is None else logp[i])
                    if r.done:
                        break
            except Exception as e:  # noqa: BLE001  (as _sample: this row fails alone)
                if not self.fail_alone:
                    raise
                self.fail(r, e)

    def _recompute(self, rows: list[Request]) -> None:
        """Rows past their cache: the newest block_size tokens of each, whole, without a cache (learned
        positions re-cropped every step, as cache-free generation does)."""
        ids = torch.tensor([r.context()[-self.block :] for r in rows], dtype=torch.long, device=self.device)
        self._sample(rows, self._forward(ids)[:, -1])

    def _sample(self, rows: list[Request], logits: torch.Tensor) -> None:
        """Each row's next token from its logits (n, V), with its own settings; then its stops. The rows that
        share settings are drawn together (sample_rows), each at a uniform number from its own generator."""
        padded = (
            logits.float()
        )  # tensor parallel's log-softmax reads the padded vocabulary as its shards hold it
        logits = padded[:, : self.vocab]
        drawn_from = constrain(rows, logits)  # a row's grammar masks its logits (log-probabilities stay raw)
        picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        groups: dict[tuple, list[int]] = {}
        for j, r in enumerate(rows):
            p = r.params
            key = (0.0, None, None) if p.temperature <= 0 else (p.temperature, p.top_k, p.top_p)
            groups.setdefault(key, []).append(j)
        for (temperature, top_k, top_p), idx in groups.items():
            every = len(idx) == len(rows)  # one group (the usual case): no copies in or out
            part = drawn_from if every else drawn_from[idx]
            if temperature <= 0:
                drawn = greedy(part)
            else:
                drawn = sample_rows(part, self._uniforms([rows[j] for j in idx]), temperature, top_k, top_p)
            if every:
                picks = drawn
            else:
                picks[idx] = drawn
        logp = None
        lps: list[float | None] = [None] * len(rows)
        if any(r.params.logprobs or r.params.top_logprobs for r in rows):
            if self.vocab_shards > 1:  # the padding's exp is 0: the vocabulary's values are unchanged
                logp = sharded_log_softmax(padded, self.vocab_shards)[:, : self.vocab]
            else:
                logp = F.log_softmax(logits, dim=-1)
            lps = logp.gather(1, picks[:, None])[:, 0].tolist()
        for j, (r, token) in enumerate(zip(rows, picks.tolist(), strict=True)):
            try:
                self._append(r, token, lps[j], None if logp is None else logp[j])
            except Exception as e:  # noqa: BLE001  (its stop text's decode, its callback: this row fails alone)
                if not self.fail_alone:
                    raise
                self.fail(r, e)

    def fail(self, req: Request, error: BaseException | str) -> None:
        """End one request with an error (req.error: a server answers 500); the other rows go on."""
        req.error = req.error or (error if isinstance(error, str) else repr(error))
        if not req.done:  # (done: only its callback failed, after it left its slot)
            # its callback may be what failed again: _leave has freed the slot before calling it
            with contextlib.suppress(Exception):
                self.cancel(req)

    def _uniforms(self, rows: list[Request]) -> torch.Tensor:
        """One uniform number in [0, 1) per row, from the row's generator (torch's global one for a row without)."""
        if all(r.generator is None for r in rows):
            return torch.rand(len(rows), device=self.device)
        return torch.cat([torch.rand(1, generator=r.generator, device=self.device) for r in rows])

    def _append(self, r: Request, token: int, lp: float | None, logp: torch.Tensor | None) -> None:
        """A sampled token (lp: its log-probability, logp the row's, when any row asked for them)."""
        p = r.params
        if token in p.stop_ids:
            r.stop_token = token
            r.stop_logprob = lp
            r.finish(STOP)
            self._leave(r)
            return
        r.tokens.append(token)
        self.generated += 1
        if lp is not None:
            r.logprobs.append(lp)
            if p.top_logprobs:
                v, i = logp.topk(min(p.top_logprobs, logp.numel()))
                r.top.append(list(zip(i.tolist(), v.tolist(), strict=True)))
        if r.hits_stop_text(self.decode):
            r.finish(STOP)
        elif len(r.tokens) >= p.max_tokens:
            r.finish(LENGTH)
        elif not r.recompute and len(r.prompt) + len(r.tokens) > self.max_len:
            if self.extends:  # check() keeps an extending row within its slot
                raise AssertionError("a row outgrew its slot")
            r.recompute = True  # learned positions past block_size: re-cropped from now on
        if r.done:
            self._leave(r)
        elif r.on_token is not None:
            r.on_token(r)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
