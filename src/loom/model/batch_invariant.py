"""Batch-invariant forwards on a CPU: a token's numbers do not depend on what else is in the forward.

An RL sampler decodes a row one token at a time beside whichever rows are running (loom.engine), and the
trainer then runs the whole sequence in one forward beside the rest of its batch. In fp32 the two agree to
~5e-7, not bit for bit: PyTorch's CPU kernels choose their paths by shape. Measured here (torch 2.13, MKL,
AVX-512): a matrix product's rows change with fewer than 8 rows (a decode step of a few rows), a softmax
changes when its row is shorter than the vector width (16; the early positions of a sequence), `q @ kᵀ`
with fewer than 4 keys and `p @ v` over 2-3 keys change too, and an elementwise function (cos, exp, GELU)
may take a scalar path for the elements past the last whole vector. Under `batch_invariant()` loom
computes the same values along one path whatever the shapes:

  - F.linear on fewer than 16 rows runs on 16 (zero rows added, then dropped);
  - attention (F.scaled_dot_product_attention's calls) is written out: q @ kᵀ, a mask, a softmax, p @ v,
    with the queries padded to 16 rows and the keys to 16 columns (the padded keys masked), so every
    product and softmax runs on the shapes where its values do not move;
  - cos, sin, exp, rsqrt, tanh, sigmoid, erf, GELU and SiLU run on a buffer padded to a multiple of 64 values.

Then the sampler's log-probability of every token it draws equals the trainer's bit for bit (tests/unit/
test_batch_invariant.py and tests/distributed/test_rl_layouts.py). As Thinking Machines' "Defeating
Nondeterminism in LLM Inference" (2025) and vLLM's batch-invariant mode do on GPUs, by choosing shapes instead
of writing kernels. The cost is a written-out attention (its (T, T) weights kept for the backward) and a
Python hook on every torch call of the forward: for RL's short answers it is small (`loom rl` measures it
in rl/rollout_s and dt: +19 % a step on the README's arithmetic recipe). Measured in fp32, and under bf16
autocast (benchmarks/rl_logprob_precision.py: 0 in both). Tensor parallel's products take DTensors: their
rows are padded on each rank (no placement there splits the rows), and the engine takes its log-probabilities
from the vocabulary shards as loss_parallel does (loom.parallel.tensor.sharded_log_softmax); FSDP's unsharded
parameters are plain tensors. Off on GPUs (its claims are measured on this CPU's kernels only) and with
attention dropout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROWS = 16  # the fewest rows a product runs on, and the fewest keys attention sees
CHUNK = 64  # elementwise functions run on a multiple of this many values

_UNARY = {
    torch.cos,
    torch.Tensor.cos,
    torch.sin,
    torch.Tensor.sin,
    torch.exp,
    torch.Tensor.exp,
    torch.rsqrt,
    torch.Tensor.rsqrt,
    torch.tanh,
    torch.Tensor.tanh,
    torch.sigmoid,
    torch.Tensor.sigmoid,
    torch.erf,
    torch.Tensor.erf,
    F.gelu,
    F.silu,
}


def _pad(x: torch.Tensor, dim: int, n: int, value: float = 0.0) -> torch.Tensor:
    """x with its size along dim raised to n (value past the end)."""
    if x.size(dim) >= n:
        return x
    shape = list(x.shape)
    shape[dim] = n - x.size(dim)
    return torch.cat([x, x.new_full(shape, value)], dim)


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (..., C) as (ROWS, C): its rows, then zero rows. A DTensor (tensor parallel: replicated, or sharded
    along C) is padded on each rank's local rows, which no placement here splits."""
    flat = x.reshape(rows, x.size(-1))
    if type(flat) is torch.Tensor:
        return _pad(flat, 0, ROWS)
    # the DTensor's own class rebuilds it: the model layer imports nothing distributed (test_layers)
    shape = (ROWS, flat.size(-1))
    padded = _pad(flat.to_local(), 0, ROWS)
    mesh, placements = flat.device_mesh, flat.placements
    return type(flat).from_local(padded, mesh, placements, run_check=False, shape=shape, stride=(shape[1], 1))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.numel() // x.size(-1)
    if rows >= ROWS:
        return F.linear(x, weight, bias)
    out = F.linear(_rows(x, rows), weight, bias)[:rows]
    return out.reshape(*x.shape[:-1], out.size(-1)).clone()  # not a view: FSDP hooks a module's output


def _attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v on padded shapes: (B, H, Tq, D) queries over (B, H, L, D) keys."""
    Tq, L = q.size(-2), k.size(-2)
    Lp = max(L, ROWS)
    scale = q.size(-1) ** -0.5 if scale is None else scale
    s = (_pad(q, -2, ROWS) @ _pad(k, -2, Lp).transpose(-2, -1))[..., :Tq, :] * scale
    hidden = torch.zeros(Tq, Lp, dtype=torch.bool, device=q.device)
    hidden[:, L:] = True  # the padded keys
    if is_causal:  # query i sees keys 0..i (top-left aligned, as F.scaled_dot_product_attention)
        hidden[:, :L] |= torch.ones(Tq, L, dtype=torch.bool, device=q.device).triu(1)
    s = s.masked_fill(hidden, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~_pad(attn_mask, -1, Lp, True), float("-inf"))
        else:
            s = s + _pad(attn_mask, -1, Lp)
    p = s.softmax(-1)
    out = _pad(p, -2, ROWS) @ _pad(v, -2, Lp)
    return out if Tq >= ROWS else out[..., :Tq, :].clone()


def _unary(func, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    n = x.numel()
    if n % CHUNK == 0:
        return func(x, *args, **kwargs)
    flat = _pad(x.reshape(-1), 0, n + CHUNK - n % CHUNK)
    return func(flat, *args, **kwargs)[:n].reshape(x.shape).clone()


def _cpu_tensors(args) -> bool:
    """Plain CPU tensors first (not a DTensor shard, not a GPU's)."""
    return bool(args) and type(args[0]) is torch.Tensor and args[0].device.type == "cpu"


def _cpu_rows(args) -> bool:
    """A product's input on a CPU: a plain tensor, or a tensor-parallel DTensor whose rows are whole."""
    x = args[0] if args else None
    if type(x) is torch.Tensor:
        return x.device.type == "cpu"
    placements = getattr(x, "placements", None)  # DTensor: Replicate, or Shard of the last dim only
    if placements is None or x.device.type != "cpu":
        return False
    return all(not p.is_shard() or p.dim in (-1, x.dim() - 1) for p in placements)


class _Invariant(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and _cpu_rows(args):
            return _linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention and _cpu_tensors(args) and len(args) == 3:
            if not kwargs.get("dropout_p") and not kwargs.get("enable_gqa"):
                return _attention(*args, **kwargs)
        if func in _UNARY and _cpu_tensors(args) and "out" not in kwargs:
            return _unary(func, *args, **kwargs)
        return func(*args, **kwargs)


def batch_invariant(on: bool = True) -> contextlib.AbstractContextManager:
    """The context under which forwards are batch-invariant (a no-op context when not `on`)."""
    return _Invariant() if on else contextlib.nullcontext()
