"""Mixture of experts: loom's GPT (Llama options) with routed SwiGLU experts in place of some blocks' MLP.

Shapes as in gpt.py, plus N = B*T tokens, E routed experts, k = top_k, H the expert width.

A MoE block's MLP is `MoE`: a router (C -> E, no bias) scores every token, the top-k experts take it and
their outputs are summed with the (renormalised) scores as weights; shared experts (DeepSeek) run on every
token besides. No token is dropped (dropless, as torchtitan and Megatron's default): an expert takes however
many tokens chose it, so the experts run as one grouped GEMM over variable-sized groups
(`torch._grouped_mm` where it runs, a loop of matmuls otherwise: the same numbers).

Load balancing, both ways (either, both or none):
  aux loss (Switch / GShard; DeepSeek-V3's sequence-wise form): coef * E * sum_i f_i P_i per sequence,
    f_i the share of the sequence's k*T choices that went to expert i and P_i its mean normalised score,
    averaged over the sequences; per sequence, so a batch split over data-parallel ranks (or micro-steps)
    gives the same loss as one batch.
  auxiliary-loss-free bias (DeepSeek-V3, Wang et al. 2024): a per-expert bias added to the scores for the
    top-k choice only (not to the weights); after each optimizer step it moves by bias_update_rate towards
    balance: b_i += rate * sign(mean load - load_i), the loads counted over the whole global batch
    (`balance_step`, called by the trainer with a sum over the data-parallel ranks).

Expert parallelism is applied from outside (loom.parallel.expert): it sets `MoE.dispatch`, which sends the
tokens to the ranks of their experts and back; the experts' weights are then DTensors sharded over the
expert-parallel ranks and each rank runs its own (`_local`). Nothing here knows about ranks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom import compat
from loom.model.gpt.gpt import GPT, MLP, Block, GPTConfig


@dataclass
class MoEConfig(GPTConfig):
    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts per token
    moe_every: int = 1  # every k-th layer (after the first dense ones) is a MoE layer
    first_dense: int = 0  # the first layers keep a dense MLP (DeepSeek: 3)
    n_shared: int = 0  # shared experts (every token), as one SwiGLU of n_shared x the expert width
    expert_hidden: int = 0  # an expert's width; 0: ffn_width
    score: str = "softmax"  # softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
    norm_topk: bool = True  # the k weights renormalised to sum to 1
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    gemm: str = "auto"  # auto (grouped where it runs) | grouped | loop

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or self.ffn_width

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_dense and (layer - self.first_dense) % self.moe_every == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_moe(i)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's experts: a weight sharded over the expert-parallel ranks is a DTensor (loom.parallel.expert)."""
    return t.to_local() if hasattr(t, "to_local") else t


# torch._grouped_mm has a CPU kernel from torch 2.13
_CPU_GROUPED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def grouped_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm runs on these operands: on CPUs (torch >= 2.13, fp32/bf16/fp16), on GPUs in bf16
    (Hopper's grouped GEMM); on both with 16-byte aligned rows of the input and the output (the CPU
    kernel too refuses others: "strides should be multiple of 16 bytes", the output's in backward). Under
    torch.compile in bf16 only: the kernel's meta function, which compile traces, refuses other types."""
    if not compat.has_grouped_mm():
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # its compiled (meta) kernel: bf16 only
        return False
    aligned = x.size(-1) * x.element_size() % 16 == 0 and w.size(-2) * x.element_size() % 16 == 0
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and aligned
    cpu_types = (torch.float32, torch.bfloat16, torch.float16)
    return x.device.type == "cpu" and _CPU_GROUPED and x.dtype in cpu_types and aligned


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Rows of x (M, in), grouped by counts (G,) in order, each group times its matrix w[g]^T (w: (G, out,
    in), nn.Linear's layout): (M, out). grouped: one torch._grouped_mm; loop: a matmul per group."""
    w = w.to(x.dtype)  # autocast does not cover _grouped_mm: compute in the activations' dtype
    if impl == "grouped" or (impl == "auto" and grouped_ok(x, w)):
        offs = counts.cumsum(0).to(torch.int32)
        return compat.grouped_mm(x, w.transpose(-2, -1), offs)
    parts = x.split(counts.tolist())
    return torch.cat([p @ w[g].t() for g, p in enumerate(parts)]) if parts else x.new_zeros(0, w.size(-2))


class Experts(nn.Module):
    """E SwiGLU experts as three (E, ...) weights in nn.Linear's (out, in) layout: gate and up (E, H, C),
    down (E, C, H), the layout of transformers' Qwen3-MoE and DeepSeek-V3 experts."""

    def __init__(self, n: int, dim: int, hidden: int, impl: str = "auto"):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, hidden))
        self.impl = impl

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, C): rows grouped by this rank's experts, counts (E_local,) rows each -> (M, C)."""
        g, u, d = _local(self.gate_proj), _local(self.up_proj), _local(self.down_proj)
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # as autocast runs nn.Linear (it does not cover _grouped_mm)
            x = x.to(torch.get_autocast_dtype(kind))
        h = F.silu(grouped_mm(x, g, counts, self.impl)) * grouped_mm(x, u, counts, self.impl)
        return grouped_mm(h, d, counts, self.impl)


class MoE(nn.Module):
    """Routed (and shared) experts in place of a block's MLP: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k, self.score = cfg.n_experts, cfg.top_k, cfg.score
        self.norm_topk, self.aux_coef, self.rate = cfg.norm_topk, cfg.aux_loss_coef, cfg.bias_update_rate
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.n_embd, cfg.expert_width, cfg.gemm)
        shared = dataclasses.replace(cfg, mlp="swiglu", ffn_hidden=cfg.n_shared * cfg.expert_width, dropout=0)
        self.shared = MLP(shared) if cfg.n_shared else None
        # DeepSeek-V3's balance bias: in the top-k choice only; saved with the model (it shapes the routing)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=True)
        # tokens each expert took since the last balance_step (training forwards): a plain attribute, not a
        # buffer, so no wrapper (DDP broadcasts buffers) overwrites one rank's counts with another's
        self.load: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None  # this forward's balance loss (training, aux_coef > 0)
        self.aux_sum, self.aux_rows = 0.0, 0  # the balance loss summed over sequences since the last step
        # set from outside by expert parallelism (loom.parallel.expert): (rows grouped by global expert,
        # counts (E,), experts) -> their outputs in the same order, computed on the experts' ranks
        self.dispatch = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (N, E) normalised, top-k ids (N, k), their weights (N, k)), in fp32: every layout routes
        each token by the same fp32 arithmetic on the same replicated router."""
        logits = F.linear(h.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        ids = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, ids)
        if self.norm_topk and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = x.reshape(-1, C)
        scores, ids, weights = self.route(h)
        flat = ids.reshape(-1)  # (N*k): token t's choices at t*k .. t*k + k-1
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=self.n_experts)
        xs = h[order // self.top_k]
        ys = self.experts(xs, counts) if self.dispatch is None else self.dispatch(xs, counts, self.experts)
        ys = ys[torch.argsort(order)].view(-1, self.top_k, C)  # back to (token, choice)
        y = (ys * weights.unsqueeze(-1).to(ys.dtype)).sum(1)  # the same order of sums on every layout
        if self.shared is not None:
            y = y + self.shared(x).reshape(-1, C)
        if self.training and torch.is_grad_enabled():
            self._account(scores.view(B, T, -1), flat.view(B, -1), counts)
        return y.view(B, T, C).to(x.dtype)

    def _account(self, scores: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> None:
        """The load since the last balance step, and this forward's sequence-wise balance loss (kept for
        the loss when aux_coef > 0, and reported either way)."""
        counts = counts.detach().float()
        self.load = counts if self.load is None else self.load + counts
        B, T, E = scores.shape
        share = torch.zeros(B, E, device=scores.device).scatter_add_(
            1, ids, torch.ones_like(ids, dtype=torch.float)
        ) * (E / (self.top_k * T))  # f_i per sequence, 1 when balanced
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        aux = (share * probs.mean(1)).sum(-1)  # (B,): 1 when balanced
        self.aux_loss = aux.mean() if self.aux_coef else None
        self.aux_sum = aux.detach().sum() + self.aux_sum
        self.aux_rows += B

    def stats(self, n_experts: int, device) -> torch.Tensor:
        """(load (E), balance-loss sum over sequences, sequences) since the last balance step."""
        load = self.load if self.load is not None else torch.zeros(n_experts, device=device)
        aux = torch.as_tensor(self.aux_sum, dtype=torch.float, device=device).reshape(1)
        rows = torch.tensor([float(self.aux_rows)], device=device)
        return torch.cat([load.to(device), aux, rows])

    def forget_load(self) -> None:
        """Drop the counts since the last balance step (after it; after a forward that was not a step's)."""
        self.load, self.aux_sum, self.aux_rows = None, 0.0, 0

    @torch.no_grad()
    def balance_step(self, total_load: torch.Tensor, update: bool = True) -> dict[str, float]:
        """After an optimizer step, with the global batch's load (E,) (summed over the data-parallel ranks):
        move the bias (update: the step was taken), forget the counts, and return what metrics.jsonl reports."""
        mean = total_load.mean()
        if self.rate and update:
            self.expert_bias += self.rate * torch.sign(mean - total_load)
        self.forget_load()
        return {
            "max_mean": float(total_load.max() / mean) if mean > 0 else math.nan,
            "bias_norm": float(self.expert_bias.norm()),
        }


class MoEBlock(Block):
    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        self.mlp = MoE(cfg)


class MoEGPT(GPT):
    """GPT whose layers cfg.moe_layers have MoE blocks; the training loss adds the balance loss."""

    def make_block(self, cfg: MoEConfig, layer: int) -> nn.Module:
        return MoEBlock(cfg) if cfg.is_moe(layer) else Block(cfg)

    @torch.no_grad()
    def init_param(self, name: str, t: torch.Tensor, seed: int) -> None:
        """GPT's rule; the balance bias starts at 0 (a buffer: loom.parallel.init materializes it too)."""
        if name.endswith("expert_bias"):
            t.zero_()
        else:
            super().init_param(name, t, seed)

    def init_std(self, name: str, module: nn.Module | None) -> float:
        """An expert's down projection is a residual output, scaled by depth as GPT's are."""
        residual = name.endswith("experts.down_proj") or getattr(module, "residual_scale", False)
        return 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02

    def forward(self, idx, targets=None, cache=None, last: int = 0):
        out = super().forward(idx, targets, cache, last)
        if targets is None or not self.training or not self.cfg.aux_loss_coef:
            return out
        aux = sum(m.aux_loss for m in self.modules() if isinstance(m, MoE))
        if hasattr(out, "to_local"):  # a tensor-parallel loss (a replicated DTensor): the same on every rank
            aux = type(out).from_local(aux, out.device_mesh, out.placements, run_check=False)
        return out + self.cfg.aux_loss_coef * aux

    def num_active_params(self) -> int:
        """Parameters a token passes through: the routed experts count k of E."""
        c = self.cfg
        idle = (c.n_experts - c.top_k) * 3 * c.n_embd * c.expert_width
        return self.num_params() - idle * len(c.moe_layers)
