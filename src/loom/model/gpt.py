"""A GPT for one device, readable top to bottom.

Shapes: B batch, T time (tokens), C = n_embd channels, H heads, D = C / H head size, V padded vocabulary.
Parallelism is applied from outside (loom.parallel); nothing here knows about ranks. Attention keeps separate
q/k/v projections and infers the number of local heads from the projection width, so tensor parallelism can
shard heads without touching this file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    dropout: float = 0.0
    bias: bool = False

    @property
    def padded_vocab(self) -> int:
        """Vocabulary rounded up to a multiple of 64: tensor-core friendly and divisible by small TP degrees."""
        return (self.vocab_size + 63) // 64 * 64


class KVCache:
    """Keys and values of every layer for incremental decoding: (B, H, max_T, D) per layer."""

    def __init__(self, cfg: GPTConfig, batch: int, max_len: int, device, dtype):
        shape = (batch, cfg.n_head, max_len, cfg.n_embd // cfg.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.len = 0  # tokens already cached

    def reset(self) -> None:
        self.len = 0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        C = cfg.n_embd
        self.head_dim = C // cfg.n_head
        self.q_proj = nn.Linear(C, C, bias=cfg.bias)
        self.k_proj = nn.Linear(C, C, bias=cfg.bias)
        self.v_proj = nn.Linear(C, C, bias=cfg.bias)
        self.o_proj = nn.Linear(C, C, bias=cfg.bias)
        self.o_proj.residual_scale = True  # GPT-2 init: scaled by 1/sqrt(2 * n_layer)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C) -> (B, H, T, D); -1 lets a tensor-parallel shard hold fewer heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:
            start = cache.len
            cache.k[layer][:, :, start : start + T] = k
            cache.v[layer][:, :, start : start + T] = v
            k, v = cache.k[layer][:, :, : start + T], cache.v[layer][:, :, : start + T]
            if start == 0:  # prefill: ordinary causal attention
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # new queries see every cached key and the causal part of their own block
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C_local)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.down_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.down_proj.residual_scale = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (GPT-2)
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        # GPT-2: N(0, 0.02) everywhere; residual output projections scaled by 1/sqrt(2 * n_layer) so the
        # residual stream's variance does not grow with depth.
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(m, "residual_scale", False) else 0.02
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """Logits (B, T, V) when targets is None, else the mean cross-entropy over all target tokens."""
        B, T = idx.shape
        start = cache.len if cache is not None else 0
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        if cache is not None:
            cache.len += T
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (the tied head is the token embedding)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n
