"""A third model family, as a plug-in with a key of its own: GPT-J's parallel block (Wang & Komatsuzaki 2021),
x + attn(ln(x)) + mlp(ln(x)), on loom's GPT otherwise. Its key, model.parallel_norms, is 1 (GPT-J: one norm
feeds both) or 2 (GPT-NeoX's parallel residual: attention and the MLP read their own norm). It exists to show
(and test) that a family with keys of its own is one folder plus one registration: nothing in loom names it.
Loaded with LOOM_PLUGINS=loom_parallel_gpt and this folder's parent on PYTHONPATH."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from loom.config import FAMILIES, Config, family_key
from loom.errors import LoomError
from loom.model.flops import flops_per_token
from loom.model.gpt import gpt_parallel
from loom.model.gpt.family import gpt_config
from loom.model.gpt.gpt import GPT, MLP, CausalSelfAttention, GPTConfig, norm_layer
from loom.model.registry import ModelSpec, register


@dataclass
class ParallelKeys:
    """The family's config section: accepted as model.<key> when model.family=parallel-gpt."""

    parallel_norms: int = family_key(
        1, "Norms of the parallel block: 1 (GPT-J: one feeds attention and the MLP) | 2 (GPT-NeoX).", ge=1
    )


def check(cfg: Config) -> None:
    """The family's own rule, run by config.validate."""
    if cfg.model.parallel_norms > 2:
        raise LoomError(
            f"model.parallel_norms={cfg.model.parallel_norms}: a parallel block has one norm or two",
            hint="use model.parallel_norms=1 (GPT-J) or 2 (GPT-NeoX)",
        )


@dataclass
class ParallelGPTConfig(GPTConfig):
    parallel_norms: int = 1


class ParallelBlock(nn.Module):
    """Attention and the MLP side by side on the block's input; their outputs join the residual together."""

    def __init__(self, cfg: ParallelGPTConfig):
        super().__init__()
        self.ln_1 = norm_layer(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm_layer(cfg, cfg.n_embd) if cfg.parallel_norms == 2 else None
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache=None, layer: int = 0) -> torch.Tensor:
        h = self.ln_1(x)
        return x + self.attn(h, cache, layer) + self.mlp(h if self.ln_2 is None else self.ln_2(x))


class ParallelGPT(GPT):
    block_cls = ParallelBlock


def parallel_config(cfg: Config, vocab_size: int) -> ParallelGPTConfig:
    gpt = dataclasses.asdict(gpt_config(cfg, vocab_size))
    return ParallelGPTConfig(**gpt, parallel_norms=cfg.model.parallel_norms)


def flops(cfg, seq_len=None) -> int:
    return flops_per_token(cfg, seq_len)  # the same matrices as GPT's block: only their order differs


register(
    ModelSpec(
        name="parallel-gpt",
        config=parallel_config,
        build=ParallelGPT,
        parallel=gpt_parallel,  # the same module names: GPT's tensor-parallel plan and stage split apply
        flops_per_token=flops,
        preset={**FAMILIES["gpt2"]},
        keys=ParallelKeys,
        check=check,
        position_table=lambda model: model.wpe,
        ring_attention=True,
    )
)
