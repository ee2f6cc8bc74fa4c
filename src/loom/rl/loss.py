"""The policy-gradient loss of a micro-batch: per trained target, the clipped importance-weighted advantage
(PPO's surrogate with DAPO's asymmetric bounds) plus, optionally, the k3 estimate of the KL to the reference,
summed (the stage divides by the global batch's trained targets: DAPO's token-level normalisation).

With one optimizer step per batch the ratio is exp(lp - sampler's lp), 1 up to the sampler/trainer difference,
and the gradient is that of -sum(adv * lp): a cross-entropy weighted by the advantages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.parallel.tensor import local, whole


def target_logprobs(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each target (B, T), 0 where the target is -1; log-softmax (B, T, V)). Under tensor
    parallel the logits are vocabulary shards (a DTensor, in loss_parallel's context): log-softmax and the
    NLL's pick are loss_parallel's ops, and each rank gets every target's value (the pick is exact: -(-x))."""
    logp = F.log_softmax(logits.float(), dim=-1)
    nll = F.nll_loss(logp.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none")
    return -local(nll).view(y.shape), logp


def k3(ref_lp: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || reference) per token: exp(d) - d - 1, d = ref - lp (>= 0)."""
    d = ref_lp - lp
    return torch.exp(d) - d - 1


def policy_loss(
    logits: torch.Tensor,
    y: torch.Tensor,
    adv: torch.Tensor,
    old_lp: torch.Tensor,
    clip: tuple[float, float],
    ref_lp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss summed over trained targets, sums and maxima for the metrics: targets, clipped targets,
    entropy, KL, the largest |lp - old_lp|)."""
    mask = y != -1
    lp, logp = target_logprobs(logits, y)
    ratio = torch.exp(lp - old_lp)
    low, high = clip
    clipped = ratio.clamp(1 - low, 1 + high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    per_token = -surrogate
    kl = None
    if ref_lp is not None:
        kl = k3(ref_lp, lp)
        per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum()
    with torch.no_grad():
        m = mask.float()
        entropy = whole(-(logp.exp() * logp).sum(-1))  # tp: a sum over the vocabulary shards
        diff = ((lp - old_lp).abs() * m).max() if mask.any() else lp.new_zeros(())
        stats = {
            "targets": m.sum(),
            "clipped": (((clipped * adv) < (ratio * adv)).float() * m).sum(),  # the bound chosen: no gradient
            "entropy": (entropy * m).sum(),
            "kl": (kl * m).sum() if kl is not None else lp.new_zeros(()),
            "logprob_diff": diff,
        }
    return loss, stats
