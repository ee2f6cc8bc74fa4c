"""The model's CPU fast paths: PyTorch's kernels serve GPUs well, and on CPUs two of them cost more than the
layer around them (dropout's serial bernoulli_ draws, bf16 attention's fallback). Each function here falls
back to the plain PyTorch call off the CPU, so the model file stays the readable single-device GPT."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def cpu_bf16_autocast(t: torch.Tensor) -> bool:
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
    if not cpu_bf16_autocast(q):
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


def inference_layout(model: nn.Module) -> int:
    """A CPU model that only runs forwards (served, chatted with, evaluated): each nn.Linear weight's values
    stored transposed, (in, out) in memory, as the same (out, in) tensor. F.linear then multiplies by a
    contiguous (in, out) matrix, the product BLAS runs fastest at the few rows of a decode step: 1.8-1.9x for
    16 rows of 256 -> 768/1024, 1.4x for the 256 -> 4096 head, the same speed (within a few %) at 64-1024
    rows, and the same values bit for bit from 16 rows up (`loom bench generate`; transformers' GPT-2 keeps
    its Conv1D weights this way). Only plain CPU tensors are moved (not DTensor shards, not quantised weights,
    not GPU ones: cuBLAS runs both layouts alike). A head tied to the embedding gets a transposed copy of its
    own (the embedding's row lookups would turn into strided gathers): V x C more memory, GPT-2's 154 MB. Returns
    how many moved. Not for a model that trains on: its optimizer and gradient buckets expect the parameters
    as they were given, and a tied head is tied no more."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    moved = 0
    with torch.no_grad():
        for m in model.modules():
            if not isinstance(m, nn.Linear):
                continue
            w = m.weight
            if type(w.data) is torch.Tensor and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous():
                if id(w) in embeddings:
                    m.weight = nn.Parameter(w.data.t().contiguous().t(), requires_grad=w.requires_grad)
                else:
                    w.data = w.data.t().contiguous().t()
                moved += 1
    return moved
