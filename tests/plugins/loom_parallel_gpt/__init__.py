"""A third model family, as a plug-in: GPT-J's parallel block (Wang & Komatsuzaki 2021), x + attn(ln(x)) +
mlp(ln(x)) with one LayerNorm, on loom's GPT otherwise. It exists to show (and test) that a family is one
folder plus one registration: nothing in loom names it. Loaded with LOOM_PLUGINS=loom_parallel_gpt and this
folder's parent on PYTHONPATH."""

from __future__ import annotations

import torch
import torch.nn as nn

from loom.config import FAMILIES
from loom.model.gpt import gpt_parallel
from loom.model.gpt.family import gpt_config
from loom.model.flops import flops_per_token
from loom.model.gpt.gpt import GPT, MLP, CausalSelfAttention, norm_layer
from loom.model.registry import ModelSpec, register


class ParallelBlock(nn.Module):
    """One norm feeds attention and the MLP side by side; their outputs join the residual together."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = norm_layer(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache=None, layer: int = 0) -> torch.Tensor:
        h = self.ln_1(x)
        return x + self.attn(h, cache, layer) + self.mlp(h)


class ParallelGPT(GPT):
    block_cls = ParallelBlock


def flops(cfg, seq_len=None) -> int:
    return flops_per_token(cfg, seq_len)  # the same matrices as GPT's block: only their order differs


register(
    ModelSpec(
        name="parallel-gpt",
        config=gpt_config,
        build=ParallelGPT,
        parallel=gpt_parallel,  # the same module names: GPT's tensor-parallel plan and stage split apply
        flops_per_token=flops,
        preset={**FAMILIES["gpt2"]},
    )
)
