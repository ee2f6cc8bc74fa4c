"""Multi-token prediction (model.mtp_depth, model.mtp_weight): DeepSeek-V3's sequential MTP modules
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2), sharing the model's embedding and output head.

Module k (k = 1..D) predicts the token k + 1 places ahead. At position i it combines the previous depth's
hidden state h^{k-1}_i (h^0: the main model's last block's output, before the final norm) with the embedding
of token t_{i+k}:

    h'^k_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]        M_k: a (2C -> C) projection
    h^k    = TRM_k(h'^k)                                             one transformer block, causal over i
    P^k    = OutHead(h^k)                                            the main model's final norm and head

for i = 0 .. T-1-k (the positions whose token t_{i+k+1} is in the window), and the training loss is

    L = L_main + (mtp_weight / D) * sum_k CE(P^k_i, t_{i+k+1})

(the report's L_MTP = lambda / D * sum_k L^k). In loom's terms, with inputs x and targets y (y_i = x_{i+1}):
module k reads x[:, k:] and h^{k-1}[:, :T-k], and is scored against y[:, k:]. Only training adds the MTP
term: evaluation (val_loss, eval) and generation are the main model's, as DeepSeek-V3 discards the modules at
inference; `mtp_logits` gives the modules' predictions for self-speculative decoding.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.model.doc_mask import DocMask, doc_mask_head


class MTPModule(nn.Module):
    """One depth: the two norms, the projection M_k and the block TRM_k (`block`: the model's block class)."""

    def __init__(self, cfg, block: nn.Module):
        super().__init__()
        self.norm_h = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.norm_e = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False)
        self.block = block

    def forward(self, h: torch.Tensor, emb: torch.Tensor, doc: DocMask | None = None) -> torch.Tensor:
        """h (B, T', C) the previous depth's states, emb (B, T', C) the embeddings of the tokens k ahead; doc:
        the documents of h's positions (data.doc_mask), within which the block's attention stays."""
        x = self.proj(torch.cat([self.norm_h(h), self.norm_e(emb)], dim=-1))
        return self.block(x) if doc is None else self.block(x, doc=doc)


def mtp_hidden(
    modules: nn.ModuleList, wte: nn.Module, h: torch.Tensor, idx: torch.Tensor, doc: DocMask | None = None
) -> list[torch.Tensor]:
    """[h^1, ..., h^D]: h^k (B, T-k, C) from h^0 = h (B, T, C) and the input ids idx (B, T). doc (data.doc_mask):
    the window's documents; position i of every depth belongs to token i's document (h^0_i saw only that one),
    so module k's attention keeps to the documents of positions 0 .. T-1-k (and, with restarting positions,
    RoPE turns by their places in them)."""
    out, T = [], idx.size(1)
    for k, module in enumerate(modules, start=1):
        if T - k <= 0:
            break
        sub = doc_mask_head(doc, T - k) if doc is not None else None
        h = module(h[:, : T - k], wte(idx[:, k:]), sub)
        out.append(h)
    return out


def mtp_loss(logits_of, hidden: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """sum_k CE(head(h^k), y[:, k:]) / D over the depths computed (`logits_of`: final norm and head)."""
    total = torch.zeros((), device=targets.device)
    for k, h in enumerate(hidden, start=1):
        logits = logits_of(h)
        y = targets[:, k:]
        total = total + F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1
        )
    return total / max(len(hidden), 1)


def mtp_depth(model: nn.Module) -> int:
    """How many multi-token-prediction modules `model` has (0: none, or a family that builds none): what
    speculation outside model/ asks, instead of probing a family's config."""
    return int(getattr(model.cfg, "mtp_depth", 0) or 0)
