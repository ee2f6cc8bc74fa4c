"""The RL stage (loom.train.stage's protocol): batches that are rollouts, a policy-gradient micro-batch loss,
and the figures of each step (rl/*, in metrics.jsonl)."""

from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path

import torch

from loom.config.validate import derive_batch
from loom.data.sft import validation_set
from loom.data.slice import DataSlice
from loom.errors import LoomError, StopBeforeStep
from loom.model.batch_invariant import batch_invariant
from loom.rl import heldout  # noqa: F401  (registers the held-out pass@k evaluator)
from loom.rl.async_rollout import AsyncRollouts, worker_spec
from loom.rl.episode import Episodes, env_rollout
from loom.rl.loss import policy_loss, target_logprobs
from loom.rl.prompts import check_stops, load_prompts, parse_stops, rl_template
from loom.rl.rewards import RewardGuard, load_reward
from loom.rl.rollout import Batch, Timer, build_batch, prompt_index, sample, sample_seed

_MAXED = ("logprob_diff", "is_max")  # figures that are maxima over micro-batches, not sums


class RL:
    """Reinforcement learning on verifiable rewards (loom.rl's docstring: GRPO with DAPO's normalisation)."""

    name = "rl"

    @staticmethod
    def applies(cfg, meta: dict) -> bool:
        return bool(cfg.rl.prompts)

    def __init__(self, cfg, data_dir: Path, meta: dict, part: DataSlice, device: torch.device):
        r = self.rl = cfg.rl
        self.cfg, self.device, self.part, self.meta = cfg, device, part, meta
        self.template = rl_template(data_dir, meta)
        self.reward = load_reward(r.reward, r.answer_field, r.pattern)
        self.guard = RewardGuard(r.reward_timeout)  # rl.reward_timeout, and stop signals during scoring
        self.stops = parse_stops(r.stop)  # rl.stop: texts that end an answer (a base run's, say a newline)
        check_stops(self.template.tok, self.stops)
        # rl.env: multi-turn episodes with an environment (loom.rl.episode), its class imported now
        self.env = Episodes(r, self.template, self.stops, cfg.model.block_size) if r.env else None
        self.prompts = load_prompts(
            r.prompts, self.reward.field, self.template, cfg.model.block_size, r.max_new_tokens
        )
        # what a resume must keep (Rollouts.load_state_dict): the prompts' content, wherever the file is now
        self.prompts_sha256 = hashlib.sha256(Path(r.prompts).read_bytes()).hexdigest()
        self.ranks = part.dp_size * part.cp_size  # the ranks the gradients are averaged over
        self.batches = Rollouts(self)
        self.valset = validation_set(cfg, data_dir, meta, cfg.train.eval_batches * cfg.train.batch_size, part)
        self.source_valsets: dict = {}
        self.parallel, self.autocast, self.ref = None, contextlib.nullcontext, None
        self.chunks: list | None = None
        self.sums: dict = {}
        self.trained_tokens: int | None = None  # the last step's trained targets: the trainer's tokens/s, MFU
        self.heldout = None  # the held-out evaluator (loom.rl.heldout), when rl.eval_prompts is set
        # batch-invariant forwards where they are measured to hold (CPU kernels); elsewhere not even the hook
        self.invariant = r.batch_invariant and device.type == "cpu"
        # where the forwards may differ, truncated importance sampling against the sampler's (loom.rl.loss);
        # begin() turns it on under autocast too (bf16: the forwards differ even batch-invariant)
        self.corrected = not self.invariant and r.is_cap > 0
        self.vocab = meta["vocab_size"]  # the logits past it are padding: left out as the engine does
        self.data_dir = data_dir  # rl.max_staleness: the rollout worker reads the tokenizer from it

    def begin(self, parallel, autocast) -> None:
        """The model the rollouts sample from (this rank's, as it trains) and the sampling precision (the step's:
        the sampler's log-probabilities are the trainer's); the frozen reference with rl.kl_coef > 0."""
        self.parallel, self.autocast = parallel, autocast
        with autocast():  # batch-invariance is exact in fp32 only: in bf16 the README's 4 x 128 model's
            low = torch.is_autocast_enabled(self.device.type)  # log-probabilities differ by up to 0.05
        self.corrected = (not self.invariant or low) and self.rl.is_cap > 0
        if self.batches.worker is not None:  # rl.max_staleness: answers of older weights, always corrected
            self.corrected = True  # (validate: rl.is_cap > 0)
            self.batches.worker.start(*worker_spec(self, low))
        if self.rl.kl_coef > 0:
            self.ref = reference_model(self.cfg, self.meta, self.device)

    # ------------------------------------------------------------------ the loss
    def micro_loss(self, forward, x: torch.Tensor, y: torch.Tensor, i: int, grad_accum: int) -> torch.Tensor:
        """The micro-batch's policy-gradient loss, summed over its targets, over the global batch's trained
        targets N, times the ranks the gradients are averaged over. N == 0 (every group dropped): weight 0."""
        if self.chunks is None:  # the batch's per-target tensors, split as the trainer splits x and y
            self.chunks = self.batches.chunks(grad_accum)
        adv, old, ref = self.chunks.pop(0)
        with batch_invariant(self.invariant):  # the sampler's forwards ran under it too
            logits = forward(x)
        clip = (self.rl.clip_low, self.rl.clip_high)
        if (
            self.corrected
        ):  # TIS: the ratio against the trainer's first forward, weighted against the sampler's
            b = self.batches
            prox = b.prox[i] if b.uses > 1 else None
            loss, stats = policy_loss(
                logits, y, adv, prox, clip, ref, self.rl.kl_coef, old, self.rl.is_cap, self.vocab
            )
            if prox is None:
                b.prox[i] = stats.pop("old_lp")
        else:
            loss, stats = policy_loss(logits, y, adv, old, clip, ref, self.rl.kl_coef, vocab=self.vocab)
        for k, v in stats.items():
            self.sums[k] = (
                torch.maximum(self.sums[k], v)
                if k in _MAXED and k in self.sums
                else (self.sums.get(k, 0) + v)
            )
        total = self.batches.global_targets
        return loss * (self.ranks / total if total else 0.0)

    @contextlib.contextmanager
    def sampling(self):
        """The rollouts' forwards: the step's precision, batch-invariant as the trainer's (rl.batch_invariant)."""
        with self.autocast(), batch_invariant(self.invariant):
            yield

    def pipeline_weight(self) -> float | None:
        return None  # validate refuses rl with parallel.pp > 1

    def step_metrics(self, all_reduce_sum) -> dict:
        """The step's rl/* figures, summed or maxed over the data-parallel ranks (one collective of its own)."""
        b, sums = self.batches, self.sums
        self.sums = {}
        rec = b.report(sums)
        self.trained_tokens = rec["rl/trained_tokens"]  # not the padded batch_size x block_size
        if self.heldout is not None and self.heldout.last:  # the console line shows the latest pass@k
            rec["rl/heldout"] = dict(self.heldout.last)
        if b.worker is not None:  # rl.max_staleness: the batch's staleness, the wait for the worker
            rec.update(b.worker.figures(b.steps_before))
        return rec

    def end(self) -> None:
        if self.batches.worker is not None:
            self.batches.worker.close()


def reference_model(cfg, meta: dict, device: torch.device):
    """The frozen start model (model.init_from's weights) for the KL term, whole on this rank."""
    from loom.model.registry import spec_of
    from loom.runs import pretrained_state

    model = spec_of(cfg).build_model(cfg, meta["vocab_size"], device)
    sd = pretrained_state(cfg, model)
    missing, _ = model.load_state_dict(sd, strict=False)
    if [k for k in missing if not k.endswith("lm_head.weight")]:
        raise LoomError(f"the reference model lacks weights: {missing[:3]}")
    if cfg.model.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    model.eval().requires_grad_(False)
    # QLoRA: the policy's base is NF4; the same here (KL 0 at the start)
    if cfg.finetune.quantize_base == "nf4":
        from loom.model.nf4 import quantize_base

        quantize_base(model)
    return model


class Rollouts:
    """The RL stage's batches (a Stateful the checkpointer saves): every rl.updates_per_batch steps a new
    rollout of this rank's prompts; its state is the rollouts drawn (the samples' seeds follow from it) and, in
    the middle of a batch used for several steps, that batch."""

    def __init__(self, stage: RL):
        self.stage = stage
        cfg = stage.cfg
        self.G = cfg.rl.group_size
        self.per_rollout = cfg.train.batch_size // self.G  # prompts a rollout takes, over every rank
        self.accum = derive_batch(cfg, stage.part.dp_size).grad_accum  # build_batch fills each micro-batch
        self.rollouts = 0  # rollouts drawn
        self.uses = 0  # steps the current batch served
        self.prox: list = []  # rl.is_cap's correction: each micro-batch's trainer log-probabilities at first use
        self.batch: Batch | None = None
        self.global_targets = 0
        self.rollout_s = Timer()
        self.stats: dict = {}  # the last rollout's figures (loom.rl.score), reported once
        self.train_start = 0.0
        self.dropped_in_a_row = 0  # rollouts in a row whose every group was dropped (rl.max_dropped_steps)
        # asynchronous rollouts: sampled by a worker process (loom.rl.async_rollout)
        K = stage.rl.max_staleness
        self.worker = AsyncRollouts(K, stage.rl.updates_per_batch) if K else None
        self.steps_before = 0  # the optimizer steps taken before the current one

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.stage.rl.updates_per_batch
        self.steps_before = (self.rollouts - 1) * k + self.uses if self.rollouts else 0
        if self.worker is not None:  # the weights and the rollouts now due go to the worker
            self.worker.advance(self.steps_before, self.rollouts, self.stage.cfg.train.steps, self._job)
        if self.batch is None or self.uses >= k:
            self.batch, self.uses = self._rollout(), 0
            self.prox = [None] * self.accum
            self.rollouts += 1
        self.uses += 1
        self.stage.chunks = None
        self.train_start = time.perf_counter()
        return self.batch.x, self.batch.y

    def chunks(self, accum: int) -> list:
        """(advantages, sampler's log-probabilities, reference's) of each micro-batch, in the trainer's order."""
        b = self.batch
        ref = b.ref_lp.chunk(accum) if b.ref_lp is not None else [None] * accum
        return list(zip(b.adv.chunk(accum), b.old_lp.chunk(accum), ref, strict=True))

    def _mine(self, r: int | None = None) -> list[int]:
        """This rank's stream positions of rollout r's prompts (default: the current rollout; each rank samples
        for its own)."""
        part, P = self.stage.part, self.per_rollout
        per_rank = P // part.dp_size
        start = (self.rollouts if r is None else r) * P + part.dp_rank * per_rank
        return list(range(start, start + per_rank))

    def _job(self, r: int) -> tuple[list[list[int]], list[list[int]]]:
        """Rollout r's prompts (token ids) and their samples' seeds on this rank: the rollout worker's job."""
        st, seed = self.stage, self.stage.cfg.run.seed
        pos = self._mine(r)
        ids = [st.prompts.ids[prompt_index(p, len(st.prompts), seed)] for p in pos]
        return ids, [[sample_seed(seed, r, p, g) for g in range(self.G)] for p in pos]

    def _rollout(self) -> Batch:
        from loom.rl.score import score_groups

        st, cfg = self.stage, self.stage.cfg
        n, seed = len(st.prompts), cfg.run.seed
        pos = self._mine()
        idx = [prompt_index(p, n, seed) for p in pos]
        seeds = [[sample_seed(seed, self.rollouts, p, g) for g in range(self.G)] for p in pos]
        par = st.parallel
        if st.env is not None:  # multi-turn episodes: played, scored and batched by loom.rl.episode
            with self.rollout_s():
                batch, self.stats = env_rollout(st, idx, seeds, self.accum)
            return self._finish(batch, None)
        if self.worker is not None:  # sampled by the rollout worker (rl.max_staleness): these prompts, seeds
            reqs = self.worker.take(self.rollouts)
            self.rollout_s.s += self.worker.worker_s  # the worker's seconds (rl/rollout_wait_s: the wait)
        else:
            with self.rollout_s():
                reqs = sample(
                    par.model,  # this rank's model as it trains: whole, FSDP's shards or tensor parallel's
                    [st.prompts.ids[i] for i in idx],
                    seeds,
                    st.rl.max_new_tokens,
                    st.template.stop_ids,
                    st.meta["vocab_size"],
                    st.sampling,
                    lockstep=par.all_reduce_sum if par.fsdp_roots else None,
                    stops=st.stops,
                    decode=st.template.tok.decode,
                )
        rows = [st.prompts.rows[i] for i in idx]
        row_adv, trained, self.stats = score_groups(st, reqs, rows, self.G)
        stopped = self.stats.pop("stopped", None)  # a stop signal while the rewards were scored
        batch = build_batch(reqs, row_adv, trained, st.template.eot_id, self.accum)
        return self._finish(batch, stopped)

    def _finish(self, batch: Batch, stopped: str | None) -> Batch:
        """The rollout's batch on the device, with the reference's log-probabilities, its trained targets
        counted over the ranks (and a stop signal on any rank seen by all)."""
        st, par = self.stage, self.stage.parallel
        if st.ref is not None and stopped is None:
            with torch.no_grad():
                batch.ref_lp = target_logprobs(
                    st.ref(batch.x.to(st.device)), batch.y.to(st.device), st.vocab
                )[0]
        for name in ("x", "y", "adv", "old_lp"):
            setattr(batch, name, getattr(batch, name).to(st.device))
        local = float((batch.y != -1).sum()) if par.dims.tp_rank == 0 else 0.0  # tp ranks hold the same rows
        # one collective: the global batch's trained targets, and whether any rank was stopped while scoring
        total, stops = par.all_reduce_sum(
            torch.tensor([local, float(stopped is not None)], device=st.device)
        ).tolist()
        if stops:  # every rank abandons this rollout alike: the step is not taken, the run stops and saves
            raise StopBeforeStep(stopped or "a signal on another rank")
        self.global_targets = int(total)
        self._count_dropped()
        return batch

    def _count_dropped(self) -> None:
        """rl.max_dropped_steps: a rollout whose every group was dropped trains nothing (its loss is 0); that
        many steps of them in a row stop the run with what the rewards were, before the step is taken."""
        self.dropped_in_a_row = self.dropped_in_a_row + 1 if self.global_targets == 0 else 0
        r, k = self.stage.rl, self.stage.rl.updates_per_batch
        if not r.max_dropped_steps or self.dropped_in_a_row * k < r.max_dropped_steps:
            return
        s = self.stats
        seen = (
            f"rewards between {s['reward_min']:g} and {s['reward_max']:g} over {s['groups']} groups here, "
            f"{s['dropped_groups']} with equal rewards, {s['error_groups']} with a failed reward"
            if s.get("rewards")
            else "every reward failed"
        )
        raise LoomError(
            f"the last {self.dropped_in_a_row * k} steps dropped every group of rl.group_size={self.G} answers "
            f"({self.dropped_in_a_row} rollouts in a row, the last: {seen}): equal rewards inside a group give "
            f"no advantage, so nothing was learned (rl.max_dropped_steps={r.max_dropped_steps})",
            hint="rewards all at their lowest: the task is too hard for this model (fine-tune it more, or give "
            "easier prompts); all at their highest: too easy; a larger rl.group_size gives a group more chances "
            "to differ; check the reward with a few answers by hand. rl.max_dropped_steps=0 never stops",
        )

    def explain_rows(self, state, batch_size: int, align) -> dict:
        """What a bad step's record says of its batch: the rollout, and the rows of rl.prompts (0-based) whose
        answers it trained on, every rank's."""
        st = self.stage
        n, start = len(st.prompts), (self.rollouts - 1) * self.per_rollout
        picks = [prompt_index(p, n, st.cfg.run.seed) for p in range(start, start + self.per_rollout)]
        return {"rollout": self.rollouts, "prompts": picks}

    def report(self, sums: dict) -> dict:
        from loom.rl.score import step_report

        return step_report(self, sums)

    # ------------------------------------------------------------------ checkpoints
    def settings(self) -> dict:
        """What the rollouts drawn so far depend on besides their count: a resume with another value would
        sample other prompts or group them otherwise than the run it continues."""
        cfg = self.stage.cfg
        return {
            "group_size": self.G,
            "batch_size": cfg.train.batch_size,
            "seed": cfg.run.seed,
            "prompts": str(cfg.rl.prompts),
            "prompts_sha256": self.stage.prompts_sha256,
        }

    def state_dict(self) -> dict:
        state = {"rollouts": self.rollouts, "uses": self.uses, "dropped_in_a_row": self.dropped_in_a_row}
        state.update(self.settings())
        k = self.stage.rl.updates_per_batch
        if self.batch is not None and self.uses < k:  # the batch serves more steps: kept as it was sampled
            b = self.batch
            state["batch"] = {n: getattr(b, n).tolist() for n in ("x", "y", "adv", "old_lp")}
            if b.ref_lp is not None:
                state["batch"]["ref_lp"] = b.ref_lp.tolist()
            if self.prox and all(p is not None for p in self.prox):
                state["batch"]["prox_lp"] = torch.cat(self.prox).tolist()
            state["global_targets"] = self.global_targets
        return state

    def load_state_dict(self, state: dict) -> None:
        check_same_settings(state, self.settings())
        self.rollouts, self.uses = state["rollouts"], state["uses"]
        self.dropped_in_a_row = int(state.get("dropped_in_a_row", 0))
        saved = state.get("batch")
        if saved is None:
            self.batch = None
            return
        d = self.stage.device
        as_t = {n: torch.tensor(v, device=d) for n, v in saved.items()}
        self.batch = Batch(as_t["x"], as_t["y"], as_t["adv"], as_t["old_lp"], as_t.get("ref_lp"))
        prox = as_t.get("prox_lp")
        self.prox = list(prox.chunk(self.accum)) if prox is not None else [None] * self.accum
        self.global_targets = state["global_targets"]


_SETTING_KEYS = {
    "group_size": "rl.group_size",
    "batch_size": "train.batch_size",
    "seed": "run.seed",
    "prompts_sha256": "rl.prompts",
}


def check_same_settings(saved: dict, mine: dict) -> None:
    """A resume with another rl.group_size, train.batch_size, run.seed or prompts file (its content: the same
    file moved is the same prompts) is refused, as data.mix refuses another mixture: the rollouts after it would
    not be the run's (checkpoints written before these were saved are not checked)."""
    changed = []
    for key, name in _SETTING_KEYS.items():
        if key not in saved or saved[key] == mine[key]:
            continue
        if key == "prompts_sha256":
            changed.append(
                f"rl.prompts: the run's were '{saved.get('prompts')}' (sha256 {saved[key][:12]}), this "
                f"resume's '{mine['prompts']}' holds other prompts (sha256 {mine[key][:12]})"
            )
        else:
            changed.append(f"{name}: the run's {saved[key]}, this resume's {mine[key]}")
    if changed:
        raise LoomError(
            "the checkpoint's rollouts were drawn with other RL settings than this resume's ("
            + "; ".join(changed)
            + "): the rollouts after it would not be the run's",
            hint="resume with the run's own rl.group_size, train.batch_size, rl.prompts and run.seed, or start "
            "a new run from its weights (loom rl --model.init_from=run:RUN ...)",
        )
