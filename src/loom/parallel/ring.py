"""Context parallel, ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers
for Near-Infinite Context"): each of the cp ranks of a group keeps its queries, the keys and values travel
around the group, one neighbour to the next, and each rank folds every block of keys into its output with the
online softmax (Milakov & Gimelshein 2018; FlashAttention's log-sum-exp merge), so no rank ever holds the attention
of the whole sequence.

Load balance. With causal attention, consecutive chunks would leave rank 0 idle for all but one block and give
the last rank cp blocks. As in striped attention (Brandon et al. 2023, "Striped Attention: Faster Ring
Attention for Causal Transformers") the tokens are spread instead, here in the "zigzag" layout of
ring-flash-attention and Llama 3's context parallel: the sequence is cut into 2*cp chunks and rank r holds
chunks r and 2*cp-1-r (loom.data.loader.seq_chunk; positions: seq_positions). Then at ring step s, with the
keys of rank j = r - s (mod cp):
    s = 0      causal attention of the rank's own 2 chunks (in order, so one triangular mask covers them)
    j < r      every local query sees j's early chunk in full, and j's late chunk not at all
    j > r      only the late local chunk sees anything: j's two chunks, in full
so every step after the first is a (T/cp x T/(2cp)) block without a mask, on every rank.

Communication: point-to-point sends to the next rank (torch.distributed batch_isend_irecv, which gloo runs on
CPUs), each started before the block arithmetic it overlaps. Why not an all-gather of the keys and values
(simpler: one collective, a reduce-scatter for the backward)? Every rank would then hold the whole sequence's
keys and values, (B, T, 2*K*D) a layer, where the ring holds at most three blocks of T/cp tokens (its own, the
one it computes with, the one arriving): attention's memory falls as 1/cp like the rest of the activations.
Forward traffic is the same for both, cp - 1 blocks received per rank and layer; the backward passes the
blocks round again (cp - 1) and their fp32 gradients (cp steps) where an all-gather's backward reduce-scatters
once (cp - 1 blocks): about twice that traffic, the price of never holding the whole sequence. (Ulysses moves
less, (cp - 1)/cp of (B, T/cp, C) per all-to-all, but needs cp | n_kv_head and holds whole sequences.)

Backward: an autograd.Function with its own backward (FlashAttention-2's, Dao 2023, block by block): the ring
runs again, each block's softmax recomputed from the saved log-sum-exp, and the key/value gradients travel
with their block, accumulating on every rank they pass, one more step bringing them home. What is saved per
layer is q, k, v, the output and the log-sum-exp (B, H, T/cp): no (T x T) weights; a block's scores are
computed TILE query rows at a time, so the transient memory is (TILE x T/cp) per head, linear in T/cp (a fused
kernel returning the log-sum-exp, FlashAttention's, would hold less still: not used here). The arithmetic is in fp32
(bf16 autocast too), plain torch matmuls; grouped-query attention groups the query heads over the K key/value
heads that travel. Under torch.compile the ring runs eagerly (torch.compiler.disable: point-to-point sends are
not traced), the rest of each block compiled. Applied from outside the model through the attention's
`context` (model/gpt/gpt.py): the positions RoPE turns each token by, and the attention itself; learned positions
through the position table's input, as Ulysses does (loom.parallel.context).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from loom.data.loader import seq_positions


class Pending:
    """A shift in flight: wait() gives the tensor received from the previous rank once both transfers are done
    (the sent tensor is held until then: it must not change while gloo reads it)."""

    def __init__(self, works: list, received: torch.Tensor, sent: torch.Tensor):
        self.works, self.received, self.sent = works, received, sent

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.received


class Ring:
    """The cp group as a ring: shift(t) sends t to the next rank and receives the previous rank's."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def shift(self, t: torch.Tensor, tag: int = 0) -> Pending:
        t = t.contiguous()
        received = torch.empty_like(t)
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=tag),
                dist.P2POp(dist.irecv, received, group=self.group, group_peer=prev, tag=tag),
            ]
        )
        return Pending(works, received, t)


KV, DKV = 0, 1  # message tags: key/value blocks, their gradients (both travel forward in the backward pass)


def block_span(step: int, rank: int, size: int, T: int) -> tuple[slice, slice, bool]:
    """(local queries, keys of the block held at `step`, causal) for the zigzag layout (the module docstring):
    the part of the block a rank's queries attend to, T being its 2 chunks' tokens."""
    source, half = (rank - step) % size, T // 2
    if step == 0:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


TILE = 512  # query rows per tile: a block's scores are held (TILE x Tk) at a time, never (Tq x Tk)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, q0: int = 0) -> torch.Tensor:
    """q (B, K, G, Tq, D) grouped query heads, k (B, K, Tk, D) -> scaled scores (B, K, G, Tq, Tk); causal: query
    i sits at q0 + i of the block's keys and sees keys 0 .. q0 + i (-inf beyond)."""
    s = (q @ k.unsqueeze(2).transpose(-2, -1)) * scale
    if causal:
        rows = torch.arange(q0, q0 + s.size(-2), device=s.device)
        s = s.masked_fill(torch.arange(s.size(-1), device=s.device) > rows[:, None], float("-inf"))
    return s


def _tiles(q: torch.Tensor, k: torch.Tensor, causal: bool):
    """(query rows, keys they may see) of each tile of TILE query rows: with a causal block (q and k the same
    tokens) a tile's rows see only the keys up to its last row, so the keys past it are never multiplied."""
    for q0 in range(0, q.size(-2), TILE):
        rows = slice(q0, min(q0 + TILE, q.size(-2)))
        yield q0, rows, slice(0, rows.stop if causal else k.size(-2))


def attend_block(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, K, G, Tq, D) over one block of keys/values (B, K, Tk, D): the output
    (B, K, G, Tq, D) normalised within the block, and the block's log-sum-exp of the scores (B, K, G, Tq),
    TILE query rows at a time."""
    outs, lses = [], []
    for q0, rows, keys in _tiles(q, k, causal):
        s = _scores(q[..., rows, :], k[..., keys, :], causal, scale, q0)
        lse = s.logsumexp(-1)
        outs.append(torch.exp(s - lse.unsqueeze(-1)) @ v[..., keys, :].unsqueeze(2))
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: two attentions of the same queries over disjoint keys, each normalised within its
    keys, into the attention over both: weights exp(lse_i - lse) with lse = log(exp(lse_a) + exp(lse_b))."""
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(
        -1
    ), new


def attend_block_backward(q, k, v, causal, scale, lse, dout, delta):
    """Gradients of the whole attention's output with respect to q, and to this block's k and v, given the
    whole attention's log-sum-exp (B, K, G, Tq), the output's gradient dout and delta = rowsum(dout * out):
    with P = exp(S - lse) this block's share of the weights, dS = P * (dout vᵀ - delta); TILE query rows at
    a time."""
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, rows, keys in _tiles(q, k, causal):
        kt, vt, do = k[..., keys, :], v[..., keys, :], dout[..., rows, :]
        p = torch.exp(_scores(q[..., rows, :], kt, causal, scale, q0) - lse[..., rows].unsqueeze(-1))
        dv[..., keys, :] += (p.transpose(-2, -1) @ do).sum(2)  # the G query heads sharing a kv head add up
        ds = p * (do @ vt.unsqueeze(2).transpose(-2, -1) - delta[..., rows].unsqueeze(-1))
        dq[..., rows, :] = (ds @ kt.unsqueeze(2)) * scale
        dk[..., keys, :] += (ds.transpose(-2, -1) @ q[..., rows, :]).sum(2) * scale
    return dq, dk, dv


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (B, H, T, D) over the whole sequence's keys and values, of
    which this rank holds (B, K, T, D) (zigzag layout; K divides H: grouped-query). `ring` shifts tensors
    around the cp group (Ring; a test passes its own)."""

    @staticmethod
    def forward(ctx, q, k, v, ring):
        B, H, T, D = q.shape
        scale = D**-0.5
        with torch.autocast(q.device.type, enabled=False):
            qg = q.float().reshape(B, k.size(1), H // k.size(1), T, D)  # query head h reads kv head h // G
            kv = torch.stack((k, v))  # what travels, in the compute dtype (bf16 halves the traffic)
            pending = ring.shift(kv, KV) if ring.size > 1 else None
            for step in range(ring.size):
                if step > 0:
                    kv = pending.wait()
                    pending = ring.shift(kv, KV) if step < ring.size - 1 else None
                qs, ks, causal = block_span(step, ring.rank, ring.size, T)
                o, lse_b = attend_block(
                    qg[..., qs, :], kv[0, :, :, ks].float(), kv[1, :, :, ks].float(), causal, scale
                )
                if step == 0:
                    out, lse = o, lse_b
                else:
                    out[..., qs, :], lse[..., qs] = merge(out[..., qs, :], lse[..., qs], o, lse_b)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.reshape(B, H, T, D).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        B, H, T, D = q.shape
        scale = D**-0.5
        with torch.autocast(q.device.type, enabled=False):
            qg = q.float().reshape(out.shape)
            dout = grad.float().reshape(out.shape)
            delta = (dout * out).sum(-1)  # (B, K, G, T)
            dq = torch.zeros_like(qg)
            kv = torch.stack((k, v))
            dkv = torch.zeros(kv.shape, dtype=torch.float, device=kv.device)  # this rank's block's gradient
            pending = ring.shift(kv, KV) if ring.size > 1 else None
            pending_grad = None
            for step in range(ring.size):
                if step > 0:  # the previous rank's block and its gradient so far, from every rank it passed
                    kv, dkv = pending.wait(), pending_grad.wait()
                    pending = ring.shift(kv, KV) if step < ring.size - 1 else None
                qs, ks, causal = block_span(step, ring.rank, ring.size, T)
                dq_b, dk_b, dv_b = attend_block_backward(
                    qg[..., qs, :],
                    kv[0, :, :, ks].float(),
                    kv[1, :, :, ks].float(),
                    causal,
                    scale,
                    lse[..., qs],
                    dout[..., qs, :],
                    delta[..., qs],
                )
                dq[..., qs, :] += dq_b
                dkv[0, :, :, ks] += dk_b
                dkv[1, :, :, ks] += dv_b
                if ring.size > 1:  # on to the next rank: after the last step that is the block's owner
                    pending_grad = ring.shift(dkv, DKV)
            if pending_grad is not None:
                dkv = pending_grad.wait()
        return dq.reshape(B, H, T, D).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class RingContext:
    """What the model's attention asks of context parallel (CausalSelfAttention.context, model/gpt/gpt.py): the
    places of this rank's tokens in the whole sequence, and ring attention around `ring` (a Ring)."""

    def __init__(self, ring):
        self.ring = ring

    def positions(self, T: int, device) -> torch.Tensor:
        """(T,) the whole-sequence positions of the T tokens this rank holds (T * cp in the sequence)."""
        return seq_positions(T * self.ring.size, self.ring.rank, self.ring.size, "zigzag", device)

    @torch.compiler.disable  # point-to-point sends: run eagerly inside a compiled block
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return RingAttention.apply(q, k, v, self.ring)


def apply_ring(model: nn.Module, blocks: list[nn.Module], ring, wpe: nn.Module | None = None) -> None:
    """Give the attention of every block of `model` ring attention around `ring` (Ring(cp group); each attn has
    a `context` slot, ModelSpec.ring_attention: loom's GPT's), and the position table `wpe` (the family's
    ModelSpec.position_table; None: RoPE) the zigzag positions of this rank's tokens."""
    ctx = RingContext(ring)
    for block in blocks:
        block.attn.context = ctx
    if wpe is not None:  # training starts at 0: positions 0 .. T-1 become the chunk's
        wpe.register_forward_pre_hook(lambda mod, args: (ctx.positions(args[0].numel(), args[0].device),))
