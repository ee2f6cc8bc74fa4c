"""A GPT for one device, readable top to bottom.

Shapes: B batch, T time (tokens), C = n_embd channels, H heads, D = C / H head size, V padded vocabulary.
Parallelism is applied from outside (loom.parallel); nothing here knows about ranks. Attention keeps separate
q/k/v projections and infers the number of local heads from the projection width, so tensor parallelism can
shard heads without touching this file.
"""

from __future__ import annotations

import math
import zlib
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
    activation: str = "gelu_tanh"  # GPT-2's tanh approximation; "gelu": exact (erf), as nanoGPT

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


def _cpu_bf16_autocast(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )


def keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout's multiplier for x: 1 / (1 - p) with probability 1 - p, else 0, in x's dtype.

    For CPUs, where torch's generator is serial and F.dropout's bernoulli_ costs 10-20 ns a value: uniform
    16-bit draws, four cut from each random 64-bit integer (~2 ns a value), compared with p rounded to a
    multiple of 2^-16 (0.2 -> 0.199997); the scale uses the rounded p, so the expectation is x exactly."""
    if p >= 1:  # nn.Dropout(p=1) drops everything
        return torch.zeros_like(x)
    n = x.numel()
    r = torch.randint(-(2**63), 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64, device=x.device)
    threshold = round(p * 65536) - 32768  # P(int16 draw < threshold) = round(p * 65536) / 65536
    keep = r.view(torch.int16)[:n].view(x.shape) >= threshold
    return keep.to(x.dtype).mul_(65536 / (32768 - threshold))


class Dropout(nn.Dropout):
    """nn.Dropout; for plain CPU tensors the mask comes from `keep_mask` (p rounded to 2^-16, ~5x faster)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.p > 0 and x.device.type == "cpu" and type(x) is torch.Tensor:
            return x * keep_mask(x, self.p)
        return super().forward(x)  # GPUs, and tensor subclasses (DTensor) with their own RNG rules


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(q kᵀ / √D, causal) v, dropout on the weights: (B, H, T, D) -> (B, H, T, D).

    PyTorch's fused F.scaled_dot_product_attention, except under bf16 autocast on a CPU. There its bf16 paths
    are slow (the flash kernel's backward; with dropout, a fallback that draws masks with bernoulli_), so the
    product is written out in bf16 with dropout by `keep_mask`: 1.3-2.5x faster per attention layer
    (fwd+bwd, AVX512-BF16 CPU, 4 heads of 32 at T=64 and 6 of 64 at T=256, with and without dropout). Like
    the fallback, it keeps each head's (T, T) weights for the backward pass.
    """
    if not _cpu_bf16_autocast(q):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    with torch.autocast("cpu", enabled=False):  # autocast would run the softmax in fp32 (two more copies)
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        T = q.size(-2)
        future = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)  # 0 on and below
        att = ((q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)).add_(future)  # (B, H, T, T)
        att = att.softmax(dim=-1)  # bf16 out, fp32 inside the kernel
        if dropout_p > 0:
            att = att * keep_mask(att, dropout_p)
        return att @ v


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
        self.resid_dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, _ = x.shape
        if _cpu_bf16_autocast(x):  # one cast for the three projections (autocast would cast x three times)
            x = x.to(torch.bfloat16)
        # (B, T, C) -> (B, H, T, D); -1 lets a tensor-parallel shard hold fewer heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        if cache is None:
            y = causal_attention(q, k, v, drop)
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
        self.dropout = Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"  # erf: ~2.5x faster on CPUs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate)))


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
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying (GPT-2)
        if self.wte.weight.device.type != "meta":  # built on the meta device: initialised after sharding
            self.reset_parameters(int(torch.randint(2**62, ())))  # the seed follows torch.manual_seed

    def reset_parameters(self, seed: int) -> None:
        """Every parameter to its initial values for `seed` (see init_param)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_param(name, p, seed)

    @torch.no_grad()
    def init_param(self, name: str, t: torch.Tensor, seed: int) -> None:
        """Fill t, the whole parameter `name`, with its initial values.

        GPT-2: N(0, 0.02) for embeddings and matrices, residual output projections scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth; LayerNorm gains 1, biases 0. The values
        come from a generator seeded by (seed, name), so they do not depend on which other parameters exist
        or in which order they are made: a sharded or pipelined model initialises each of its pieces to the
        same weights as one process (loom.parallel builds models on the meta device and calls this per name).
        """
        if name == "lm_head.weight":
            name = "wte.weight"  # tied: one tensor
        try:
            module = self.get_submodule(name.rpartition(".")[0])
        except AttributeError:  # a pipeline stage without the embedding keeps only the tied head
            module = None
        if name.endswith(".bias"):
            t.zero_()
        elif isinstance(module, nn.LayerNorm):
            t.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_scale", False) else 0.02
            g = torch.Generator(device=t.device).manual_seed(
                (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
            )
            t.normal_(0.0, std, generator=g)

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
