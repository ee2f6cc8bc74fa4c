"""The training stage: what a step trains on and how each micro-batch's loss is weighed. Pretraining (windows of
the token stream, every target trained), supervised fine-tuning (packed conversations, the assistant's targets
only), preference tuning (pairs of answers: loom.train.dpo) and RL on verifiable rewards (rollouts of the model
itself: loom.rl.stage) are stages; the data and config choose (`build_stage`: the first of STAGES that
applies). The trainer asks its stage for the batches, the validation rows and each micro-batch's loss, lets it
begin once with the model (DPO's reference log-probabilities, RL's sampler) and add its figures to each step's
record, and never branches on which stage it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from loom import log
from loom.config import Config
from loom.config.schedules import step_shape
from loom.data.loader import DeviceBatches, ShardLoader
from loom.data.sft import ChatLoader, is_chat_data, validation_set
from loom.data.slice import DataSlice
from loom.errors import LoomError
from loom.rl.stage import RL
from loom.train.dpo import DPO


class Stage(Protocol):
    name: str
    batches: DeviceBatches  # this rank's training batches on the device (a Stateful: checkpoints save it)
    valset: Any  # the validation rows (ValSet's interface), what ValLossEval measures
    source_valsets: dict  # a mixture's per-source validation rows by source name (else empty)

    def pipeline_weight(self) -> float | None:
        """The pipeline schedule's weight per trained target of the last global batch (None: the mean of
        every target)."""

    def micro_loss(self, forward, x: torch.Tensor, y: torch.Tensor, i: int, accum: int) -> torch.Tensor:
        """Micro-batch i of `accum`'s loss (`forward`: the parallelized model), weighed so that the step's
        gradient is the global batch's."""

    def begin(self, par, autocast) -> None:
        """Before the first step of this process (after a resumed checkpoint loaded): work the stage does
        once with the model (`par`: loom.parallel.Parallelized; `autocast`: the step's precision)."""

    def step_metrics(self, all_reduce_sum) -> dict:
        """The stage's own figures of the step just taken, for metrics.jsonl (a collective: every rank)."""

    def end(self) -> None:
        """After the last step, or a run that stops or fails: what the stage started ends (RL's rollout
        worker)."""


class TokenLoss:
    """A stage whose loss is the model's mean cross-entropy over the targets, weighed by its loss_scale(y,
    grad_accum): what a micro-batch's mean loss is multiplied by so that the step's gradient is the global
    batch's, and the targets to use (a stage may change them)."""

    def micro_loss(self, forward, x: torch.Tensor, y: torch.Tensor, i: int, accum: int) -> torch.Tensor:
        scale, y = self.loss_scale(y, accum)
        return forward(x, y) * scale  # the global batch's mean over its (trained) targets

    def begin(self, par, autocast) -> None:
        pass

    def step_metrics(self, all_reduce_sum) -> dict:
        return {}

    def end(self) -> None:
        pass


def _valset(cfg: Config, data_dir: Path, meta: dict, part: DataSlice):
    """The validation rows (loom.data.sft.validation_set: what `loom eval` of this run measures too)."""
    t = cfg.train
    return validation_set(cfg, data_dir, meta, t.eval_batches * t.batch_size, part)


class Pretrain(TokenLoss):
    """Windows of the token stream (a global cursor; this rank's slice of each global batch), every target
    trained: each micro-batch has as many targets, so its mean loss weighs 1 / accumulation steps."""

    name = "pretrain"

    @staticmethod
    def applies(cfg: Config, meta: dict) -> bool:
        return True

    def __init__(self, cfg: Config, data_dir: Path, meta: dict, part: DataSlice, device: torch.device):
        t = cfg.train
        self.source_valsets: dict = {}  # data.mix: each source's own validation rows, by name
        if cfg.data.mix:
            loader = self._mix(cfg, part)
        else:
            schedule = step_shape(t, cfg.model.block_size)  # batch/sequence warm-up (None: neither)
            loader = ShardLoader(
                data_dir,
                t.batch_size,
                cfg.model.block_size,
                cfg.run.seed,
                part,
                align=cfg.data.align,
                schedule=schedule,
            )
        self.batches = DeviceBatches(loader, device)
        self.valset = _valset(cfg, data_dir, meta, part)

    def _mix(self, cfg: Config, part: DataSlice):
        """data.mix's loader (loom.data.mix), its repeats checked against train.steps, and a validation loss per
        source (each on its own val split)."""
        from loom.data.loader import ValSet
        from loom.data.mix import MixLoader, mix_weights, parse_mix

        t = cfg.train
        sources, weights = parse_mix(cfg.data.mix, cfg.data.sources)
        phases = mix_weights(weights, cfg.data.mix_schedule, sources)
        loader = MixLoader(
            sources,
            phases,
            t.batch_size,
            cfg.model.block_size,
            cfg.run.seed,
            part,
            cfg.data.align,
            cfg.data.mix_repeat,
        )
        loader.check_repeats(t.steps)
        n_rows = t.eval_batches * t.batch_size
        for s in sources:
            self.source_valsets[s.name] = ValSet(s.path, cfg.model.block_size, n_rows, part)
        return loader

    def loss_scale(self, y: torch.Tensor, grad_accum: int) -> tuple[float, torch.Tensor]:
        return 1.0 / grad_accum, y

    def pipeline_weight(self) -> float | None:
        return None


class SFT(TokenLoss):
    """Supervised fine-tuning: conversations packed best-fit into rows (with document masks; else one a row),
    targets masked to the assistant's (loom.data.sft). Each micro-batch's loss weighs by its trained targets."""

    name = "sft"

    @staticmethod
    def applies(cfg: Config, meta: dict) -> bool:
        return is_chat_data(meta)

    def __init__(self, cfg: Config, data_dir: Path, meta: dict, part: DataSlice, device: torch.device):
        t = cfg.train
        pack = cfg.data.doc_mask  # without document masks a packed conversation would see the ones before it
        if not pack:  # loom.log prints rank 0's
            log.info(
                "chat data: one conversation a row, padded (data.doc_mask=true packs several, each attending "
                "to itself only)"
            )
        self.source_valsets: dict = {}
        loader = ChatLoader(data_dir, t.batch_size, cfg.model.block_size, cfg.run.seed, part, pack=pack)
        self.batches = DeviceBatches(loader, device)
        self.valset = _valset(cfg, data_dir, meta, part)
        self.ranks = part.dp_size * part.cp_size  # the ranks the gradients are averaged over

    def loss_scale(self, y: torch.Tensor, grad_accum: int) -> tuple[float, torch.Tensor]:
        """The micro-batch's trained targets n over the global batch's N, times the dp x cp ranks the gradients
        are averaged over (each micro-batch then adds its losses' sum / N). A micro-batch with no trained target
        still runs its forward and backward (a sharded model's are collectives) on one target weighted 0: a
        mean over none is 0/0."""
        total = self.batches.valid_targets
        n = int((y != -1).sum())
        if n == 0:
            y = y.clone()
            y.view(-1)[0] = 0
            return 0.0, y
        return n * self.ranks / max(total, 1), y

    def pipeline_weight(self) -> float | None:
        return self.ranks / max(self.batches.valid_targets, 1)  # each trained target weighs dp x cp / N


STAGES: list = [RL, DPO, SFT, Pretrain]  # the first that applies to the data and config is the run's stage


def build_stage(cfg: Config, data_dir: Path, meta: dict, part: DataSlice, device: torch.device) -> Stage:
    """The run's training stage, chosen by its data and config."""
    cls = next(s for s in STAGES if s.applies(cfg, meta))
    if cls is not Pretrain and (cfg.train.batch_schedule or cfg.train.seq_schedule):
        raise LoomError(
            f"train.batch_schedule / train.seq_schedule serve pretraining; this run is {cls.name} (its data "
            f"'{data_dir}' chooses it)",
            hint="drop the schedule for this run",
        )
    return cls(cfg, data_dir, meta, part, device)
