"""Held-out pass@1 and pass@k before the first step (the baseline, step 0), every rl.eval_every steps and after
the last (an evaluator: loom.eval.evaluator).

pass@1 is the greedy answer's; pass@k the share of prompts with a correct answer among k samples at
temperature 1 (seeded: the same draws at every evaluation); correct means a reward > 0 (of a sum of rewards,
R1-Zero's format + correctness: every term > 0, loom.rl.rewards.Reward.correct)."""

from __future__ import annotations

from loom import log
from loom.data.loader import read_meta
from loom.eval.evaluator import Every, register_evaluator
from loom.rl.episode import Episodes, heldout_correct
from loom.rl.prompts import check_stops, load_prompts, parse_stops, rl_template
from loom.rl.rewards import RewardGuard, RewardStopped, load_reward
from loom.rl.rollout import answer_text, sample, sample_seed


class HeldOut(Every):
    name = "rl_heldout"
    baseline = True  # pass@k of the start model: what RL improves on

    def __init__(self, cfg, template, vocab: int):
        r = cfg.rl
        super().__init__(r.eval_every)
        self.rl, self.template, self.vocab, self.seed = r, template, vocab, cfg.run.seed
        self.reward = load_reward(r.reward, r.answer_field, r.pattern)
        self.guard = RewardGuard(r.reward_timeout)
        self.stops = parse_stops(r.stop)
        check_stops(template.tok, self.stops)
        # rl.env: each held-out prompt is an episode with the environment; correct: it ended with a reward > 0
        self.env = Episodes(r, template, self.stops, cfg.model.block_size) if r.env else None
        self.last: dict = {}  # the latest figures and their step: the RL stage puts them on the console line
        self.prompts = load_prompts(
            r.eval_prompts, self.reward.field, template, cfg.model.block_size, r.max_new_tokens
        )
        if r.eval_limit:
            self.prompts.rows, self.prompts.ids = (
                self.prompts.rows[: r.eval_limit],
                self.prompts.ids[: r.eval_limit],
            )

    def _correct(self, reqs, per: int) -> list[list[bool]]:
        """Whether each answer is correct (a reward > 0; a failed or timed-out reward is not), by prompt.
        RewardStopped: a stop signal while scoring (the evaluation is given up)."""
        out = []
        with self.guard.watching():
            for j, q in enumerate(reqs):
                if self.guard.stopped:
                    raise RewardStopped
                row, text = self.prompts.rows[j // per], answer_text(self.template.tok, q, self.stops)
                out.append(self.reward.correct(row, text, self.guard))
        return [out[i * per : (i + 1) * per] for i in range(len(self.prompts))]

    def run(self, ctx) -> dict | None:
        model = ctx.parallel.sampling_model()
        if model is None:
            return None
        ids, k = self.prompts.ids, self.rl.eval_k
        if self.env is not None:
            return self._record(ctx, self._run_env(model, ids, k, ctx.autocast))
        args = (self.rl.max_new_tokens, self.template.stop_ids, self.vocab, ctx.autocast)
        stop = {"stops": self.stops, "decode": self.template.tok.decode}
        greedy = sample(model, ids, [[0]] * len(ids), *args, temperature=0.0, **stop)
        seeds = [[sample_seed(self.seed, -1, i, g) for g in range(k)] for i in range(len(ids))]
        drawn = sample(model, ids, seeds, *args, **stop) if k > 0 else []
        try:
            rec = {"rl/pass@1": sum(c[0] for c in self._correct(greedy, 1)) / len(ids)}
            if k > 0:
                rec[f"rl/pass@{k}"] = sum(any(c) for c in self._correct(drawn, k)) / len(ids)
        except RewardStopped:  # the run stops after its next step; this evaluation is not finished
            log.warn(f"step {ctx.step}: held-out evaluation given up: {self.guard.stopped} while scoring")
            return None
        return self._record(ctx, rec)

    def _run_env(self, model, ids: list[list[int]], k: int, autocast) -> dict:
        """pass@1 (greedy) and pass@k of held-out episodes with rl.env (loom.rl.episode)."""
        rows, n = self.prompts.rows, len(ids)
        greedy = heldout_correct(self.env, model, rows, ids, [0] * n, self.vocab, autocast, 0.0)
        rec = {"rl/pass@1": sum(greedy) / n}
        if k > 0:
            seeds = [sample_seed(self.seed, -1, i, g) for i in range(n) for g in range(k)]
            many = [r for r in rows for _ in range(k)]
            drawn = heldout_correct(
                self.env, model, many, [p for p in ids for _ in range(k)], seeds, self.vocab, autocast, 1.0
            )
            rec[f"rl/pass@{k}"] = sum(any(drawn[i * k : (i + 1) * k]) for i in range(n)) / n
        return rec

    def _record(self, ctx, rec: dict) -> dict:
        self.last = {"step": ctx.step, **{key[3:]: v for key, v in rec.items()}}
        return rec

    def line(self, step: int, record: dict) -> str:
        return f"step {step}: held-out " + ", ".join(f"{k[3:]} {v:.3f}" for k, v in record.items())


def _factory(setup):
    if not setup.cfg.rl.prompts or not setup.cfg.rl.eval_prompts:
        return None
    meta = read_meta(setup.data_dir)
    ev = HeldOut(setup.cfg, rl_template(setup.data_dir, meta), meta["vocab_size"])
    if setup.stage is not None and hasattr(setup.stage, "heldout"):
        setup.stage.heldout = ev  # the RL stage's console line shows the latest pass@k
    return ev


register_evaluator("rl_heldout", _factory)
