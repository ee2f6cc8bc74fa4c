"""Rollouts: G samples per prompt from loom.engine, their rewards, group-relative advantages, and the batch the
policy-gradient step trains on (token ids, targets, and per target its advantage and the sampler's
log-probability)."""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from loom.engine import Engine, Request, SamplingParams
from loom.engine.request import cut_at_stop


def sample_seed(seed: int, rollout: int, pos: int, g: int) -> int:
    """The engine seed of sample g of the prompt at stream position pos in rollout `rollout`: the same on every
    layout and after a resume (nothing but the rollout count to save)."""
    digest = hashlib.sha256(f"{seed}:{rollout}:{pos}:{g}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def prompt_index(pos: int, n: int, seed: int) -> int:
    """The prompt at stream position pos: epoch pos // n visits every prompt once, in its own seeded order."""
    epoch, i = divmod(pos, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[i])


def sample(
    model,
    prompts: list[list[int]],
    seeds: list[list[int]],
    max_new: int,
    stop_ids,
    vocab: int,
    autocast=contextlib.nullcontext,
    temperature: float = 1.0,
    lockstep=None,
    stops: tuple[str, ...] = (),
    decode=None,
) -> list[Request]:
    """Every prompt's samples (seeds[i] holds one seed per sample) through one engine, rows in prompt order;
    lockstep: Engine.drain's, for a model sharded over ranks that sample different prompts (FSDP); stops
    (rl.stop): texts that end a row as its stop ids do (the engine reads them with `decode`), the tokens that
    wrote one kept (they train: the model learns to end)."""
    params = [
        SamplingParams(
            max_tokens=max_new,
            temperature=temperature,
            seed=s,
            stop_ids=frozenset(stop_ids),
            stop=tuple(stops),
            logprobs=True,
        )
        for group in seeds
        for s in group
    ]
    ids = [p for p, group in zip(prompts, seeds, strict=True) for _ in group]
    reqs = [Request(p, sp) for p, sp in zip(ids, params, strict=True)]
    # each row's slot holds its prompt and answer, no more; as many rows at once as 64 whole blocks' worth of
    # KV tokens allows, and at least 8,192 tokens (short answers: every sample of a rollout in one batch, fewer
    # forwards; 256 rows of 20 tokens on a block of 32 were three waves of 102)
    span = min(max(len(p) for p in ids) + max_new, model.cfg.block_size)
    rows = min(len(reqs), max(64, max(64 * model.cfg.block_size, 8192) // span))
    engine = Engine(
        model,
        max_seqs=rows,
        max_len=span,
        vocab_size=vocab,
        autocast=autocast,
        decode=decode if stops else None,
    )
    return engine.run(reqs, lockstep)


def answer_text(tok, req: Request, stops: tuple[str, ...] = ()) -> str:
    """The text a reward scores: the answer's tokens decoded, cut before the first of rl.stop's texts."""
    return cut_at_stop(tok.decode(req.tokens), stops) if stops else tok.decode(req.tokens)


def advantages(rewards: torch.Tensor, norm: str, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, kept) of rewards (groups, G): r - the group's mean, over the group's standard deviation
    (population) with norm == "std"; kept False for a group whose rewards are all equal (no signal)."""
    mean = rewards.mean(dim=1, keepdim=True)
    adv = rewards - mean
    if norm == "std":
        adv = adv / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    kept = (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
    return adv, kept


@dataclass
class Batch:
    """One rollout batch of this rank: x, y (B, T) as the trainer's batches (y -1 where nothing trains), and per
    target the row's advantage and the sampler's log-probability; `stats` what the metrics report of it."""

    x: torch.Tensor
    y: torch.Tensor
    adv: torch.Tensor
    old_lp: torch.Tensor
    ref_lp: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)


def sequences(reqs: list[Request]) -> list[tuple[list[int], list[float]]]:
    """Each request's whole sequence (prompt, answer, and the stop token it ended on: the model learns to end)
    and the sampler's log-probability of each answer token."""
    out = []
    for r in reqs:
        tokens, lps = list(r.tokens), list(r.logprobs)
        if r.stop_token is not None:
            tokens.append(r.stop_token)
            lps.append(r.stop_logprob)
        out.append((r.prompt + tokens, lps))
    return out


def build_batch(
    reqs: list[Request], row_adv: list[float], trained: list[bool], pad_id: int, accum: int = 1
) -> Batch:
    """The training rows of the requests: the trained rows (a dropped group's rows have no target: a forward
    and backward over them would add nothing), and untrained ones after them up to a multiple of accum (at
    least accum: x.chunk(accum) then gives every micro-batch of gradient accumulation its equal share of
    rows); targets are the answer tokens of trained rows."""
    rows = [j for j, t in enumerate(trained) if t]
    need = max(-(-len(rows) // accum), 1) * accum
    rows += [j for j, t in enumerate(trained) if not t][: need - len(rows)]
    reqs, row_adv, trained = [reqs[j] for j in rows], [row_adv[j] for j in rows], [trained[j] for j in rows]
    seqs = sequences(reqs)
    T = max(len(s) for s, _ in seqs) - 1
    x, y, adv, old = [], [], [], []  # rows as lists, made tensors at once (256 rows: 5 ms less a step)
    for j, ((seq, lps), r) in enumerate(zip(seqs, reqs, strict=True)):
        n, P = len(seq), len(r.prompt)
        head, tail, answer = P - 1, T - n + 1, n - P  # before the first target, after the last, targets
        keep = trained[j] and n > P
        x.append(seq[:-1] + [pad_id] * tail)
        y.append([-1] * head + (seq[P:] if keep else [-1] * answer) + [-1] * tail)
        adv.append([0.0] * head + [row_adv[j] if keep else 0.0] * answer + [0.0] * tail)
        old.append([0.0] * head + (list(lps) if keep else [0.0] * answer) + [0.0] * tail)
    x, y = torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)
    adv, old = torch.tensor(adv, dtype=torch.float32), torch.tensor(old, dtype=torch.float32)
    return Batch(x, y, adv, old)


class Timer:
    """Seconds spent inside, summed."""

    def __init__(self):
        self.s = 0.0

    @contextlib.contextmanager
    def __call__(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.s += time.perf_counter() - t0
