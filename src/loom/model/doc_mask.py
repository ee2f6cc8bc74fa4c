"""Attention that stops at document boundaries (data.doc_mask): packed training windows hold several documents,
and with this mask a token attends only to the earlier tokens of its own document, as if each document ran
alone (torchtitan's FlexAttention document masks, Megatron's packed sequences, modded-nanogpt's varlen
attention).

The model derives everything from the input ids: loom's data puts the end-of-text id before each document
(`loom data prepare`), so an end-of-text token opens a document and the tokens before the window's first one
are the tail of an earlier document, a document of their own. Nothing travels beside the ids, so a loader,
a pipeline of wrappers or a tensor-parallel plan needs no change. Shapes: B batch, T tokens, H heads, D head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F


@dataclass
class DocMask:
    """The documents of a batch of windows: doc (B, T) the document index of each token within its window,
    positions (B, T) each token's place in its document (None: positions run on across documents), and on a
    GPU FlexAttention's block mask (None on a CPU, where flex_attention has no backward in torch 2.13)."""

    doc: torch.Tensor
    positions: torch.Tensor | None
    block_mask: object | None = None


def build_doc_mask(idx: torch.Tensor, eot_id: int, restart: bool, flex: bool | None = None) -> DocMask:
    """The DocMask of input ids idx (B, T): documents open at each `eot_id`. restart: positions count from 0
    at each document's first token. flex: build FlexAttention's block mask (default: off the CPU)."""
    B, T = idx.shape
    opens = idx == eot_id
    doc = opens.cumsum(1)  # (B, T): 0 for the tail before the first end-of-text, then 1, 2, ...
    positions = None
    if restart:  # t minus the index of the last end-of-text at or before t (0 when there is none)
        t = torch.arange(T, device=idx.device).expand(B, T)
        positions = t - torch.where(opens, t, torch.zeros_like(t)).cummax(1).values
    if flex is None:
        flex = idx.device.type != "cpu"
    return DocMask(doc, positions, _block_mask(doc) if flex else None)


def _block_mask(doc: torch.Tensor):
    """FlexAttention's block mask of document ids doc (B, T): causal, within each document."""
    B, T = doc.shape

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    make = create_block_mask_fn(compiled=doc.is_cuda)
    return make(same_doc_causal, B, None, T, T, device=doc.device)


def doc_mask_head(mask: DocMask, n: int) -> DocMask:
    """The documents of the first n positions of each window (model.mtp_depth: MTP module k runs on positions
    0 .. T-1-k, each a state h_i of token i's document). A prefix of a causal document mask is one too; the
    block mask, whose shape is fixed, is rebuilt for the shorter windows."""
    doc = mask.doc[:, :n]
    positions = mask.positions[:, :n] if mask.positions is not None else None
    return DocMask(doc, positions, _block_mask(doc) if mask.block_mask is not None else None)


def dense_doc_mask(doc: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: key j visible to query i when j <= i and both are in the same document."""
    T = doc.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return (doc[:, :, None] == doc[:, None, :]).logical_and_(causal).unsqueeze(1)


def doc_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocMask, dropout_p: float
) -> torch.Tensor:
    """softmax(q kᵀ / √D) v within each document: (B, H, T, D) -> (B, H, T, D).

    FlexAttention with the block mask where there is one (it skips the blocks two documents never share);
    otherwise, and with dropout (which flex_attention does not have), scaled_dot_product_attention with the
    dense (B, 1, T, T) mask. Every query sees at least itself, so no row of the softmax is empty."""
    if mask.block_mask is not None and dropout_p == 0:
        return flex_attention_fn(compiled=q.is_cuda)(q, k, v, block_mask=mask.block_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_doc_mask(mask.doc), dropout_p=dropout_p)


@cache
def create_block_mask_fn(compiled: bool):
    """create_block_mask, compiled or eager. Eager, it evaluates the mask at every (query, key) pair into (T, T)
    tensors, gigabytes at T = 32k at every step; compiled (torchtitan's choice), it fuses that into the block
    reduction. One compiled function per process: the mask's closure (the documents) is an input to it, so a
    new batch does not recompile it."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask) if compiled else create_block_mask


@cache
def flex_attention_fn(compiled: bool):
    """flex_attention, compiled or as torch runs it eagerly. Eager FlexAttention builds the whole fp32 (B, H, T, T)
    score matrix (about 51 GB at T = 32k and 12 heads, plus a masked copy): only the compiled kernel skips the
    masked blocks and keeps memory linear in T, so a GPU always takes it, inside a compiled model or not (a
    compiled model inlines it). The CPU keeps the eager one: its compiled kernel has no backward there (torch
    2.13) and costs tens of seconds of C++ compilation. Cached: one compiled function per process, whose
    shapes torch.compile guards itself."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention
