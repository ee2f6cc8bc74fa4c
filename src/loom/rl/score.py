"""Scoring a rollout (rewards, advantages, which groups train) and the step's rl/* figures."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from loom import log
from loom.errors import LoomError
from loom.rl.rewards import RewardStopped
from loom.rl.rollout import advantages, answer_text


def score_groups(stage, reqs, rows: list[dict], G: int) -> tuple[list[float], list[bool], dict]:
    """(each row's advantage, whether it trains, the rollout's figures). A group with a sample whose reward
    failed (raised, returned a non-number, ran past rl.reward_timeout) is dropped (counted: reward_errors); so
    is one whose rewards are all equal, with rl.dynamic_sampling. Every sample failing is an error: the reward,
    not the model, is broken. A stop signal while scoring (stage.guard.stopped) ends the pass at once: every
    row untrained, stats["stopped"] set (the stage abandons the rollout)."""
    texts = [answer_text(stage.template.tok, r, stage.stops) for r in reqs]
    values, errors, first = [], 0, None
    guard = stage.guard
    with guard.watching():
        for j, text in enumerate(texts):
            if guard.stopped:
                break
            try:
                v, why = stage.reward.score(rows[j // G], text, guard)
            except RewardStopped:
                break
            if why is not None:
                errors += 1
                first = first or why
            values.append(v)
    if guard.stopped:
        return [0.0] * len(reqs), [False] * len(reqs), {"stopped": guard.stopped}
    if errors == len(values):
        raise LoomError(
            f"the reward failed on every sample of a rollout; the first: {first}",
            hint="fix the reward function (a sample is loom.rl.rewards.Sample: row, text, answer), or raise "
            "rl.reward_timeout if it only needs longer",
        )
    if errors:
        log.warn(f"{errors} samples' rewards failed and their groups were dropped; the first: {first}")
    tokens = sum(len(q.tokens) for q in reqs)
    return score_values(values, G, stage.rl.adv_norm, stage.rl.dynamic_sampling, errors, tokens)


def score_values(
    values: list, G: int, adv_norm: str, dynamic: bool, errors: int, answer_tokens: int
) -> tuple[list, list, dict]:
    """(each answer's advantage, whether it trains, the rollout's figures) of rewards in groups of G: a group
    with a failed reward (None) is dropped (error_groups), and so is one whose rewards are all equal, with
    rl.dynamic_sampling. Single answers (score_groups) and episodes (loom.rl.episode) alike."""
    groups = len(values) // G
    bad = [any(values[g * G + i] is None for i in range(G)) for g in range(groups)]
    r = torch.tensor([[0.0 if v is None else v for v in values[g * G : (g + 1) * G]] for g in range(groups)])
    adv, signal = advantages(r, adv_norm)
    keep = [not bad[g] and (bool(signal[g]) or not dynamic) for g in range(groups)]
    good = [v for v in values if v is not None]
    stats = {
        "reward_sum": sum(good),
        "reward_sq": sum(v * v for v in good),
        "rewards": len(good),
        "dropped_groups": sum(not bad[g] and not keep[g] for g in range(groups)),
        "error_groups": sum(bad),
        "reward_errors": errors,
        "answer_tokens": answer_tokens,
        "answers": len(values),
        "groups": groups,
    }
    if good:
        stats["reward_min"], stats["reward_max"] = min(good), max(good)
    row_adv = [float(adv[j // G, j % G]) for j in range(len(values))]
    trained = [keep[j // G] for j in range(len(values))]
    return row_adv, trained, stats


ROLLOUT_KEYS = (
    "reward_sum",
    "reward_sq",
    "rewards",
    "dropped_groups",
    "error_groups",
    "reward_errors",
    "answer_tokens",
    "answers",
    "groups",
    "env_dropped",  # rl.env (loom.rl.episode): episodes dropped, tool calls the environment could not run, turns
    "tool_errors",
    "turns",
)
LOSS_KEYS = ("targets", "clipped", "entropy", "kl", "is_weight", "is_truncated")


def _sum_over_ranks(stage, values: list[float]) -> list[float]:
    """A sum over the data-parallel ranks: a tensor-parallel group's ranks sample and score the same rows, so
    only its first rank's values count."""
    t = torch.tensor(values, dtype=torch.float64, device=stage.device)
    if stage.parallel.dims.tp_rank != 0:
        t.zero_()
    return stage.parallel.all_reduce_sum(t).tolist()


def _max_over_ranks(value: float | list[float]) -> float | list[float]:
    """The largest value over every rank (each of a list's, in one collective)."""
    t = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.to("cuda") if dist.get_backend() == "nccl" else t
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() if isinstance(value, list) else float(t.item())


def step_report(batches, sums: dict) -> dict:
    """The step's figures over every rank: rewards (mean, std), answer length, entropy, KL, clipped fraction,
    dropped groups, the sampler-vs-trainer log-probability difference (on a batch's first step), throughput."""
    stage, stats = batches.stage, batches.stats
    train_s = time.perf_counter() - batches.train_start
    fresh = bool(stats)  # a rollout was drawn for this step
    local = [float(sums.get(k, 0.0)) for k in LOSS_KEYS]
    local += [float(stats.get(k, 0)) for k in ROLLOUT_KEYS]
    local += [float(batches.batch.x.numel())]
    g = dict(zip((*LOSS_KEYS, *ROLLOUT_KEYS, "x_tokens"), _sum_over_ranks(stage, local), strict=True))
    rec = {}
    n = max(g["targets"], 1.0)
    rec["rl/trained_tokens"] = int(g["targets"])
    rec["rl/entropy"] = g["entropy"] / n
    rec["rl/clip_frac"] = g["clipped"] / n
    if stage.ref is not None:
        rec["rl/kl"] = g["kl"] / n
    if stage.corrected:  # rl.is_cap's truncated importance weights (loom.rl.loss)
        rec["rl/is_weight_mean"] = g["is_weight"] / n
        rec["rl/is_truncated_frac"] = g["is_truncated"] / n
        rec["rl/is_weight_max"] = _max_over_ranks(float(sums.get("is_max", 0.0)))
    rec["rl/train_tokens_per_s"] = g["x_tokens"] / max(train_s, 1e-9)
    if fresh:
        diff = float(sums["logprob_diff"]) if "logprob_diff" in sums else 0.0
        rec["rl/logprob_diff"] = _max_over_ranks(diff)
        rec.update(_rollout_figures(g, batches, stats))
    batches.stats = {}
    return rec


def _rollout_figures(g: dict, batches, stats: dict) -> dict:
    k = max(g["rewards"], 1.0)
    mean = g["reward_sum"] / k
    var = max(g["reward_sq"] / k - mean * mean, 0.0)
    lo, hi = stats.get("reward_min", math.inf), stats.get("reward_max", -math.inf)
    secs, top, neg_low = _max_over_ranks([batches.rollout_s.s, hi, -lo])
    batches.rollout_s.s = 0.0
    env = {}
    if batches.stage.env is not None:  # multi-turn episodes: their drops, tool errors and mean turns
        env = {
            "rl/env_dropped": int(g["env_dropped"]),
            "rl/tool_errors": int(g["tool_errors"]),
            "rl/turns": g["turns"] / max(g["answers"], 1.0),
        }
    return env | {
        "rl/reward_mean": mean,
        "rl/reward_std": var**0.5,
        "rl/reward_min": -neg_low,  # the range the rewards took: loom plot clips the spread to it
        "rl/reward_max": top,
        "rl/groups": int(g["groups"]),
        "rl/response_len": g["answer_tokens"] / max(g["answers"], 1.0),
        "rl/dropped_groups": int(g["dropped_groups"]),
        "rl/reward_errors": int(g["reward_errors"]),
        "rl/error_groups": int(g["error_groups"]),
        "rl/rollout_s": secs,
        "rl/rollout_tokens_per_s": g["answer_tokens"] / max(secs, 1e-9),
    }
