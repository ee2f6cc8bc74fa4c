"""Preference tuning: direct preference optimisation (DPO, Rafailov et al. 2023) and IPO (Azar et al. 2023) as
a training stage, chosen by the data (preference pairs: loom.data.pairs).

A pair's log-probability under a model is the sum of its answer's target log-probabilities (the final
assistant turn and its end of turn, the loss mask). The reference model is the model the run starts from
(`model.init_from`: with LoRA the frozen base, whose adapters start at zero; else the first weights): before
the first step every training pair's chosen and rejected log-probabilities are computed once under the job's
own layout (each data-parallel rank its share, then summed) and kept in the loader's state, so checkpoints carry
them and a resumed run compares against the same reference. With h = (pi_c - ref_c) - (pi_r - ref_r):

    sigmoid (DPO):  -log sigmoid(beta * h)
    ipo:            (h - 1 / (2 beta))^2, the log-probabilities averaged over each answer's tokens (as TRL)

The step's loss is the mean over the global batch's pairs (every micro-batch holds as many whole pairs, so
each weighs 1 / accumulation steps, and the data-parallel gradient mean does the rest). Metrics per step:
dpo/chosen_reward and dpo/rejected_reward (beta times each side's log-ratio to the reference, means),
dpo/margin (their difference) and dpo/accuracy (the share of pairs whose chosen reward is the larger).
Data parallel (ddp, fsdp, zero) and tensor parallel; pipeline and context parallel are refused (a pair's
log-probability would be split over stages or sequence chunks).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loom.config import Config
from loom.data.loader import DeviceBatches
from loom.data.pairs import PairLoader, is_preference_data
from loom.data.sft import validation_set
from loom.data.slice import DataSlice
from loom.errors import LoomError
from loom.parallel.tensor import local


def preference_loss(
    policy: torch.Tensor, reference: torch.Tensor, beta: float, loss: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each pair's loss (n,), its rewards (n, 2): chosen, rejected) from the log-probabilities (n, 2) of
    each pair's chosen and rejected answer under the policy and the reference."""
    ratios = policy - reference
    h = ratios[:, 0] - ratios[:, 1]
    if loss == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {loss!r}")
    return losses, beta * ratios.detach()


def sequence_logps(forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its trained targets (y != -1), (B,). Under tensor parallel the
    logits are vocabulary shards and this runs within the loss context (loss_parallel), as the loss does."""
    logits = forward(x)
    flat = logits.float().view(-1, logits.size(-1))
    nll = F.cross_entropy(flat, y.reshape(-1), ignore_index=-1, reduction="none")
    return -local(nll).view(y.shape).sum(-1)


def check_layout(cfg: Config) -> None:
    """Preference tuning's layouts: a pair's log-probability is a sum over a whole row on one rank."""
    p = cfg.parallel
    if p.pp > 1 or p.cp > 1:
        raise LoomError(
            f"preference tuning runs on data and tensor parallel layouts; parallel.pp={p.pp}, cp={p.cp} would "
            "split each answer's log-probability over ranks",
            hint="use data parallel (ddp, fsdp) and/or parallel.tp, with pp=1 and cp=1",
        )


class DPO:
    """Preference pairs (loom.data.pairs): a chosen and a rejected row per pair, the DPO or IPO loss against
    the reference log-probabilities computed before the first step."""

    name = "dpo"

    @staticmethod
    def applies(cfg: Config, meta: dict) -> bool:
        return is_preference_data(meta)

    def __init__(self, cfg: Config, data_dir: Path, meta: dict, part: DataSlice, device: torch.device):
        check_layout(cfg)
        t = cfg.train
        micro = t.micro_batch_size or t.batch_size // part.dp_size
        if micro % 2:
            raise LoomError(
                f"train.micro_batch_size={micro} rows: a micro-batch holds whole pairs (2 rows each)",
                hint="use an even train.micro_batch_size",
            )
        self.micro_pairs = micro // 2
        self.loader = PairLoader(data_dir, t.batch_size, cfg.model.block_size, cfg.run.seed, part)
        self.batches = DeviceBatches(self.loader, device)
        self.valset = validation_set(cfg, data_dir, meta, t.eval_batches * t.batch_size, part)
        self.source_valsets: dict = {}
        self.beta, self.loss = cfg.dpo.beta, cfg.dpo.loss
        self.device = device
        self._sums = torch.zeros(4, dtype=torch.float64, device=device)  # rewards, correct, pairs
        self._step_pairs: tuple[int, np.ndarray] | None = None  # (first global pair, this rank's pairs)

    # ------------------------------------------------------------------ the reference, once
    def begin(self, par, autocast) -> None:
        """Before the first step: every training pair's reference log-probabilities (unless a resumed
        checkpoint brought them), each data-parallel rank computing its share with the job's layout."""
        if self.loader.reference is None:
            self.loader.set_reference(self._reference(par, autocast))

    def end(self) -> None:
        pass

    @torch.no_grad()
    def _reference(self, par, autocast) -> np.ndarray:
        dims, pairs = par.dims, self.loader.pairs
        mine = np.arange(dims.dp_rank, len(pairs), dims.dp)
        rounds = math.ceil(math.ceil(len(pairs) / dims.dp) / self.micro_pairs)  # alike on every rank
        out = torch.zeros(len(pairs), 2, dtype=torch.float64, device=self.device)
        model = par.model
        was_training = model.training
        model.eval()
        for r in range(rounds):
            ids = mine[r * self.micro_pairs : (r + 1) * self.micro_pairs]
            rows = ids if len(ids) else np.zeros(1, dtype=np.int64)  # a rank short of pairs runs one anyway
            x, y = (t.to(self.device) for t in pairs.rows(rows))
            with par.loss_context(), autocast():
                logps = sequence_logps(par.forward, x, y).view(-1, 2)
            if dims.tp_rank == 0 and len(ids):  # one copy of each value: the sum below is exact
                out[torch.from_numpy(ids).to(self.device)] = logps.double()
        model.train(was_training)
        return par.all_reduce_sum(out).float().cpu().numpy()

    # ------------------------------------------------------------------ a step
    def _micro_pairs(self, i: int) -> np.ndarray:
        """The pairs of micro-batch i of this rank's batch last handed out (from the loader's cursor)."""
        start = self.batches.state_dict()["cursor"] - self.loader.n_pairs
        if self._step_pairs is None or self._step_pairs[0] != start:
            self._step_pairs = (start, self.loader.local_pairs(start))
        return self._step_pairs[1][i * self.micro_pairs : (i + 1) * self.micro_pairs]

    def micro_loss(self, forward, x: torch.Tensor, y: torch.Tensor, i: int, accum: int) -> torch.Tensor:
        """Micro-batch i's mean pair loss over the accumulation steps; its rewards added to the step's sums."""
        assert self.loader.reference is not None, "begin() computes the reference before the first step"
        policy = sequence_logps(forward, x, y).view(-1, 2)
        ref = torch.from_numpy(self.loader.reference[self._micro_pairs(i)]).to(policy.device)
        if self.loss == "ipo":  # IPO's log-probabilities are per-token means
            tokens = (y != -1).sum(-1).view(-1, 2).clamp(min=1)
            policy, ref = policy / tokens, ref / tokens
        losses, rewards = preference_loss(policy, ref, self.beta, self.loss)
        correct = (rewards[:, 0] > rewards[:, 1]).sum().to(rewards.dtype)
        count = rewards.new_tensor(float(len(losses)))
        self._sums += torch.stack([rewards[:, 0].sum(), rewards[:, 1].sum(), correct, count]).to(self._sums)
        return losses.mean() / accum

    def step_metrics(self, all_reduce_sum) -> dict:
        """The step's rewards, margin and accuracy over the global batch (a sum over every rank: tensor-parallel
        ranks count each pair alike, so the means are the same)."""
        s = all_reduce_sum(self._sums).tolist()
        self._sums.zero_()
        n = max(s[3], 1)
        chosen, rejected = s[0] / n, s[1] / n
        return {
            "dpo/chosen_reward": chosen,
            "dpo/rejected_reward": rejected,
            "dpo/margin": chosen - rejected,
            "dpo/accuracy": s[2] / n,
        }

    def pipeline_weight(self) -> float | None:
        return None  # never asked: check_layout refuses pipeline parallel
