"""Multi-turn episodes (rl.env): the model and an environment take turns until the environment says the episode
is done; the whole exchange is one training row whose environment tokens are context only.

An episode's sequence is the prompt, then each model turn (sampled by loom.engine, the row's context prefilled
again each turn) and each observation the environment answered with. Only the model's tokens are targets: an
observation's tokens (and the framing around them) are -1 in y, so they carry no loss, no importance ratio and
no part of rl/logprob_diff (loom.rl.loss masks every figure by y != -1).

How an observation is written (`Framing`):
  - the text format (a base run, or chat data without tool roles): a turn ends at one of the environment's
    `stop` texts (`</calc>`) or at a stop id, and the observation's text follows it as is, in the same turn;
  - the chat template's tool role (chat data prepared with tool messages: its tokenizer has the tool tokens): a
    turn ends at <|assistant_end|>, and the observation is a tool message, <|tool_start|> text <|tool_end|>,
    followed by <|assistant_start|> for the model's next turn, as loom's chat template writes a conversation
    (so SFT on such conversations, whose tool messages are masked, teaches the same format).

Limits: rl.max_turns model turns, at most rl.max_new_tokens each, and rl.max_episode_tokens tokens after the
prompt (0: what model.block_size leaves); an episode that reaches either without the environment ending it is
dropped, as is one whose environment call fails (loom.rl.env), counted in rl/env_dropped. A group with a
dropped episode does not train (its advantages would compare against a missing reward).

Each turn's sample seed follows from the episode's (the step, the prompt's place, the sample index) and the
turn, so episodes are the same on every layout and after a resume, as single answers are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from loom import log
from loom.engine import Engine, Request, SamplingParams
from loom.engine.request import cut_at_stop
from loom.errors import LoomError
from loom.rl import env as envlib
from loom.rl.env import EnvFault
from loom.rl.rollout import Batch
from loom.rl.score import score_values


@dataclass
class Episode:
    """One episode: `ids` the whole sequence, `mine` 1 where a token is the model's (a target), `lps` the
    sampler's log-probability of each of the model's tokens (0 elsewhere)."""

    ids: list[int]
    prompt_len: int
    mine: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    env: object | None = None
    reward: float = 0.0
    turns: int = 0
    done: bool = False
    dropped: str | None = None
    answer_tokens: int = 0

    def __post_init__(self):
        self.mine = [0] * len(self.ids)
        self.lps = [0.0] * len(self.ids)

    def add(self, ids: list[int], lps: list[float] | None = None) -> None:
        """Tokens of the model's (with their log-probabilities) or, lps None, of the environment's."""
        self.ids += ids
        self.mine += [int(lps is not None)] * len(ids)
        self.lps += list(lps) if lps is not None else [0.0] * len(ids)

    @property
    def live(self) -> bool:
        return not self.done and self.dropped is None


def turn_seed(seed: int, turn: int) -> int:
    """The engine seed of an episode's turn: its own seed on the first turn, then one derived from both."""
    if turn == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:turn{turn}".encode()).digest()[:8], "little") >> 1


class Framing:
    """How observations enter the sequence (the module's docstring): the text format or the tool role."""

    def __init__(self, template, env_stops: tuple[str, ...], rl_stops: tuple[str, ...]):
        self.template = template
        self.tool_role = bool(getattr(template, "tools", False))
        self.rl_stops = rl_stops
        # the texts that end a model's turn: a tool call's end in the text format; the end of turn with roles
        self.stops = rl_stops if self.tool_role else (*env_stops, *rl_stops)
        if self.tool_role:
            from loom.data.chat import ASSISTANT_START, TOOL_END, TOOL_START

            ids = template.ids
            self.before, self.after = [ids[TOOL_START]], [ids[TOOL_END], ids[ASSISTANT_START]]
        else:
            self.before, self.after = [], []

    def encode(self, text: str) -> list[int]:
        """An observation's ids, framed; EnvFault when the tokenizer cannot write it back as it is."""
        tok = self.template.tok
        enc = getattr(self.template, "encode", None) if self.tool_role else None
        try:
            ids = enc(text) if enc is not None else tok.encode(text)
        except LoomError as e:
            raise EnvFault(f"the observation {text[:40]!r} cannot be encoded: {e.message}") from None
        if tok.decode(ids) != text:
            raise EnvFault(f"the observation {text[:40]!r} does not come back from the tokenizer's ids")
        return [*self.before, *ids, *self.after]

    def first(self, prompt: list[int], text: str) -> list[int]:
        """The prompt followed by a first observation (with roles, a tool message before the model's turn)."""
        if not text:
            return list(prompt)
        obs = self.encode(text)
        return prompt[:-1] + obs if self.tool_role else prompt + obs


class Episodes:
    """The rl.env settings and the episodes' loop (a stage's, and the held-out evaluator's)."""

    def __init__(self, rl, template, stops: tuple[str, ...], block_size: int):
        self.cls = envlib.load_env(rl.env)
        self.timeout = rl.env_timeout_s
        self.max_turns, self.max_new = rl.max_turns, rl.max_new_tokens
        self.budget, self.block_size = rl.max_episode_tokens, block_size
        self.template = template
        self.framing = Framing(template, tuple(getattr(self.cls, "stop", ())), stops)

    def start(self, row: dict, prompt: list[int]) -> Episode:
        """A new episode: its environment made and reset (a fault drops it from the start)."""
        ep = Episode(list(prompt), len(prompt))
        try:
            ep.env = envlib.new_env(self.cls, self.timeout)
            obs = envlib.reset(ep.env, row, self.timeout)
            first = self.framing.first(prompt, obs)
        except EnvFault as e:
            ep.dropped = f"reset: {e}"
            return ep
        ep.ids, ep.mine, ep.lps = first, [0] * len(first), [0.0] * len(first)
        return ep

    def limit(self, ep: Episode) -> int:
        """The episode's last allowed length: its prompt plus rl.max_episode_tokens, within the block."""
        cap = ep.prompt_len + self.budget if self.budget else self.block_size
        return min(cap, self.block_size)

    def play(self, model, rows, prompts, seeds, vocab, autocast, temperature=1.0, lockstep=None, device=None):
        """Every episode (rows[i] with prompts[i], seeds[i] its sample seed) played to its end or its drop."""
        eps = [self.start(r, p) for r, p in zip(rows, prompts, strict=True)]
        for turn in range(self.max_turns):
            for ep in eps:
                if ep.live and self.limit(ep) - len(ep.ids) <= 0:
                    ep.dropped = "no room left in its token budget"
            live = [(ep, s) for ep, s in zip(eps, seeds, strict=True) if ep.live]
            if lockstep is not None:  # FSDP: every rank runs the same number of turns (its forwards pair up)
                if not lockstep(torch.tensor([float(len(live))], device=device)).item():
                    break
            elif not live:
                break
            reqs = self._sample(model, live, turn, vocab, autocast, temperature, lockstep)
            for (ep, _), req in zip(live, reqs, strict=True):
                self._answer(ep, req)
        for ep in eps:
            if ep.live:
                ep.dropped = f"not done after rl.max_turns={self.max_turns} turns"
        return eps

    def _sample(self, model, live, turn, vocab, autocast, temperature, lockstep) -> list[Request]:
        """One turn of every live episode through one engine (the rows' contexts prefilled)."""
        tok = self.template.tok
        stop_ids = frozenset(self.template.stop_ids)
        reqs = []
        for ep, seed in live:
            room = min(self.max_new, self.limit(ep) - len(ep.ids))
            params = SamplingParams(
                max_tokens=room,
                temperature=temperature,
                seed=turn_seed(seed, turn),
                stop_ids=stop_ids,
                stop=self.framing.stops,
                logprobs=True,
            )
            reqs.append(Request(ep.ids, params))
        span = min(max((len(r.prompt) + r.params.max_tokens for r in reqs), default=1), self.block_size)
        rows = min(max(len(reqs), 1), max(64, max(64 * self.block_size, 8192) // span))
        engine = Engine(
            model,
            max_seqs=rows,
            max_len=span,
            vocab_size=vocab,
            autocast=autocast,
            decode=tok.decode if self.framing.stops else None,
        )
        return engine.run(reqs, lockstep)

    def _answer(self, ep: Episode, req: Request) -> None:
        """The model's turn into the episode, then the environment's answer to it."""
        tokens, lps = list(req.tokens), list(req.logprobs)
        if req.stop_token is not None:  # the stop id it ended on: trained (the model learns to end a turn)
            tokens.append(req.stop_token)
            lps.append(req.stop_logprob)
        ep.add(tokens, lps)
        ep.turns += 1
        ep.answer_tokens += len(tokens)
        text = self.template.tok.decode(list(req.tokens))
        if self.framing.rl_stops:
            text = cut_at_stop(text, self.framing.rl_stops)
        try:
            obs, reward, done = envlib.step(ep.env, text, self.timeout)
            ep.reward += reward
            if done:
                ep.done = True
                return
            ids = self.framing.encode(obs) if obs else []
        except EnvFault as e:
            ep.dropped = f"step: {e}"
            return
        if len(ep.ids) + len(ids) > self.limit(ep):
            ep.dropped = "its observation does not fit its token budget"
            return
        ep.add(ids)


def score_episodes(eps: list[Episode], G: int, adv_norm: str, dynamic: bool) -> tuple[list, list, dict]:
    """(each episode's advantage, whether it trains, the rollout's figures), as loom.rl.score.score_groups
    scores single answers: a group with a dropped episode is dropped (error_groups), and so is one whose rewards
    are all equal, with rl.dynamic_sampling."""
    values = [None if ep.dropped else ep.reward for ep in eps]
    dropped = [ep.dropped for ep in eps if ep.dropped]
    if dropped:
        log.warn(f"{len(dropped)} of {len(eps)} episodes dropped; the first: {dropped[0]}")
    tokens = sum(ep.answer_tokens for ep in eps)
    row_adv, trained, stats = score_values(values, G, adv_norm, dynamic, 0, tokens)
    stats["env_dropped"] = len(dropped)
    stats["tool_errors"] = sum(envlib.tool_errors(ep.env) for ep in eps if ep.env is not None)
    stats["turns"] = sum(ep.turns for ep in eps)
    return row_adv, trained, stats


def episode_batch(
    eps: list[Episode], row_adv: list[float], trained: list[bool], pad_id: int, accum: int
) -> Batch:
    """The training rows of the episodes, as loom.rl.rollout.build_batch makes them of single answers (the
    trained rows, then untrained ones up to a multiple of accum); the targets are the model's tokens only."""
    rows = [j for j, t in enumerate(trained) if t]
    need = max(-(-len(rows) // accum), 1) * accum
    rows += [j for j, t in enumerate(trained) if not t][: need - len(rows)]
    T = max(len(eps[j].ids) for j in rows) - 1
    x, y, adv, old = [], [], [], []
    for j in rows:
        ep, keep = eps[j], trained[j]
        ids, n = ep.ids, len(ep.ids)
        tail = T - n + 1
        x.append(ids[:-1] + [pad_id] * tail)
        y.append([t if keep and m else -1 for t, m in zip(ids[1:], ep.mine[1:], strict=True)] + [-1] * tail)
        adv.append([row_adv[j] if keep and m else 0.0 for m in ep.mine[1:]] + [0.0] * tail)
        old.append(
            [lp if keep and m else 0.0 for lp, m in zip(ep.lps[1:], ep.mine[1:], strict=True)] + [0.0] * tail
        )
    x, y = torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)
    adv, old = torch.tensor(adv, dtype=torch.float32), torch.tensor(old, dtype=torch.float32)
    return Batch(x, y, adv, old)


def env_rollout(st, idx: list[int], seeds: list[list[int]], accum: int) -> tuple[Batch, dict]:
    """The RL stage's rollout with rl.env: G episodes per prompt, scored and batched (loom.rl.stage)."""
    G = len(seeds[0]) if seeds else st.rl.group_size
    rows = [st.prompts.rows[i] for i in idx for _ in range(G)]
    prompts = [st.prompts.ids[i] for i in idx for _ in range(G)]
    flat = [s for group in seeds for s in group]
    par = st.parallel
    eps = st.env.play(
        par.model,
        rows,
        prompts,
        flat,
        st.vocab,
        st.sampling,
        lockstep=par.all_reduce_sum if par.fsdp_roots else None,
        device=st.device,
    )
    row_adv, trained, stats = score_episodes(eps, G, st.rl.adv_norm, st.rl.dynamic_sampling)
    return episode_batch(eps, row_adv, trained, st.template.eot_id, accum), stats


def heldout_correct(
    episodes: Episodes, model, rows, prompts, seeds, vocab, autocast, temperature
) -> list[bool]:
    """Whether each held-out episode ended with a reward above 0 (a dropped one is not correct)."""
    eps = episodes.play(model, rows, prompts, seeds, vocab, autocast, temperature=temperature)
    return [ep.dropped is None and ep.reward > 0 for ep in eps]
