"""Context parallel, DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models"): each of the cp ranks of a group holds T / cp
consecutive tokens of every sequence (loom.data.loader.seq_chunk), and everything but attention runs on that
chunk. Around attention two all-to-alls trade the split: the q/k/v projections' outputs go from sequence
shards with every head, (B, T/cp, H*D), to the whole sequence with H/cp heads, (B, T, H/cp*D); attention runs
causal over the whole sequence (RoPE then turns each token by its true position), and the output goes back
to sequence shards before o_proj. Activation memory outside attention falls as 1/cp; each all-to-all moves
(cp - 1)/cp of a (B, T/cp, C) tensor per rank.

Applied from outside the single-device model with forward hooks, on the projections the model keeps separate
(q_proj, k_proj, v_proj, o_proj: the ones tensor parallel shards); the model takes each head's sequence
length from the projection's output, so it needs nothing else. Learned positions: this rank's chunk starts at
cp_rank * T/cp, so the position table's input is offset. Needs cp | n_kv_head (config.validate).
Document masks (data.doc_mask): attention runs over the whole sequence, so the model's documents are found in
the whole sequence's ids (all-gathered over the cp group: B x T integers per step), and restarting learned
positions are cut back to the chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


def seq_to_head(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/cp, W) with W = H*D, sequence-sharded -> (B, T, W/cp), head-sharded: rank j sends its tokens of
    head group i to rank i and receives, in rank order, every rank's tokens of head group j."""
    cp = dist.get_world_size(group)
    B, Tl, W = x.shape
    send = (
        x.reshape(B, Tl, cp, W // cp).permute(2, 0, 1, 3).contiguous()
    )  # (cp, B, T/cp, W/cp): by head group
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # (cp, B, T/cp, W/cp): by sequence chunk
    return recv.permute(1, 0, 2, 3).reshape(B, cp * Tl, W // cp)


def head_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of seq_to_head: (B, T, W/cp) head-sharded -> (B, T/cp, W) sequence-sharded."""
    cp = dist.get_world_size(group)
    B, T, Wl = y.shape
    send = y.reshape(B, cp, T // cp, Wl).permute(1, 0, 2, 3).contiguous()  # (cp, B, T/cp, W/cp): by chunk
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # (cp, B, T/cp, W/cp): by head group
    return recv.permute(1, 2, 0, 3).reshape(B, T // cp, cp * Wl)


class SeqToHead(torch.autograd.Function):
    """seq_to_head whose backward is head_to_seq of the gradient (an all-to-all's adjoint is its inverse)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad):
        return head_to_seq(grad.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """head_to_seq whose backward is seq_to_head of the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return head_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_head(grad.contiguous(), ctx.group), None


def apply_ulysses(
    model: nn.Module,
    blocks: list[nn.Module],
    group,
    cp_rank: int,
    wpe: nn.Module | None = None,
    doc_mask: bool = False,
) -> None:
    """Hook Ulysses' all-to-alls around the attention of every block of `model` (the family's blocks, each
    with attn.q_proj/k_proj/v_proj/o_proj), and offset the learned positions' table `wpe` (the family's
    ModelSpec.position_table; None: RoPE) by this rank's chunk. doc_mask (data.doc_mask): the model finds its
    documents in the whole sequence."""
    for block in blocks:
        attn = block.attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.register_forward_hook(lambda mod, args, out: SeqToHead.apply(out, group))
        # before tensor parallel's own pre-hook (registered first), which wraps o_proj's input as a DTensor
        attn.o_proj.register_forward_pre_hook(
            lambda mod, args: (HeadToSeq.apply(args[0], group), *args[1:]), prepend=True
        )
    if wpe is not None:
        wpe.register_forward_pre_hook(lambda mod, args: (chunk_positions(args[0], group, cp_rank),))
    if doc_mask:  # documents of whole sequences
        local_documents = model.documents
        model.documents = lambda idx: local_documents(gather_sequence(idx, group))


def chunk_positions(pos: torch.Tensor, group, cp_rank: int) -> torch.Tensor:
    """The learned-position table's input for this rank's chunk: positions 0 .. T/cp - 1 (T,) shifted to the
    chunk's place in the whole sequence, or the whole sequence's restarting positions (B, T) cut to the chunk
    (data.doc_positions=restart: the documents were found in the whole sequence, see apply_ulysses)."""
    if pos.dim() == 1:
        return pos + cp_rank * pos.numel()
    n = pos.size(1) // dist.get_world_size(group)
    return pos[:, cp_rank * n : (cp_rank + 1) * n]


def gather_sequence(idx: torch.Tensor, group) -> torch.Tensor:
    """(B, T/cp) token ids of every cp rank -> (B, T), in rank order (ids: no gradient)."""
    parts = [torch.empty_like(idx) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, idx.contiguous(), group=group)
    return torch.cat(parts, dim=1)
