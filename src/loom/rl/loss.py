"""The policy-gradient loss of a micro-batch: per trained target, the clipped importance-weighted advantage
(PPO's surrogate with DAPO's asymmetric bounds) plus, optionally, the k3 estimate of the KL to the reference,
summed (the stage divides by the global batch's trained targets: DAPO's token-level normalisation).

With one optimizer step per batch the ratio is exp(lp - sampler's lp), 1 up to the sampler/trainer difference,
and the gradient is that of -sum(adv * lp): a cross-entropy weighted by the advantages.

Where the sampler's and the trainer's forwards differ (batch-invariance off: GPUs, or rl.batch_invariant=false),
truncated importance sampling corrects for it (TIS: Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training"; TRL's and verl's `vllm_importance_sampling_cap`): the ratio is then against the
trainer's own log-probabilities of the batch at its first step (the proximal policy), and each token's term is
weighted by w = min(exp(trainer's - sampler's), rl.is_cap), a constant (no gradient):
    per token: -w * min(r * A, clip(r, 1 - low, 1 + high) * A),   r = exp(lp - trainer's old lp).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from loom.parallel.tensor import local, whole


def target_logprobs(
    logits: torch.Tensor, y: torch.Tensor, vocab: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each target (B, T), 0 where the target is -1; log-softmax (B, T, V)). Under tensor
    parallel the logits are vocabulary shards (a DTensor, in loss_parallel's context): log-softmax and the
    NLL's pick are loss_parallel's ops, and each rank gets every target's value (the pick is exact: -(-x)).
    vocab: the logits past it (the padding) are left out first, as the engine leaves them out: a log-softmax
    over a row shorter than the CPU's vector width (a char vocabulary of 15 ids) takes another path than over
    the padded 64, and the sampler's values would differ from these in the last bit."""
    if vocab is not None and not isinstance(logits, DTensor) and logits.size(-1) > vocab:
        logits = logits[..., :vocab]
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
    old_lp: torch.Tensor | None,
    clip: tuple[float, float],
    ref_lp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    sampler_lp: torch.Tensor | None = None,
    is_cap: float = 0.0,
    vocab: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss summed over trained targets, sums and maxima for the metrics: targets, clipped targets,
    entropy, KL, the largest |lp - sampler's lp|; with the correction, the truncated weights' sum, the targets
    truncated and the largest raw weight). old_lp: the ratio's denominator, None for this forward's own
    (detached: the ratio is 1 exactly; stats["old_lp"] returns it for the batch's later steps); sampler_lp with
    is_cap > 0: the truncated importance weight against it (the module's docstring); vocab: target_logprobs'."""
    mask = y != -1
    lp, logp = target_logprobs(logits, y, vocab)
    old = lp.detach() if old_lp is None else old_lp
    ratio = torch.exp(lp - old)
    low, high = clip
    clipped = ratio.clamp(1 - low, 1 + high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    per_token = -surrogate
    weight = raw = None
    if sampler_lp is not None and is_cap > 0:
        raw = torch.exp(old - sampler_lp).detach()
        weight = raw.clamp(max=is_cap)
        per_token = per_token * weight
    kl = None
    if ref_lp is not None:
        kl = k3(ref_lp, lp)
        per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum()
    with torch.no_grad():
        m = mask.float()
        entropy = whole(-(logp.exp() * logp).sum(-1))  # tp: a sum over the vocabulary shards
        behaviour = sampler_lp if sampler_lp is not None else old
        diff = ((lp - behaviour).abs() * m).max() if mask.any() else lp.new_zeros(())
        stats = {
            "targets": m.sum(),
            "clipped": (((clipped * adv) < (ratio * adv)).float() * m).sum(),  # the bound chosen: no gradient
            "entropy": (entropy * m).sum(),
            "kl": (kl * m).sum() if kl is not None else lp.new_zeros(()),
            "logprob_diff": diff,
        }
        if weight is not None:
            stats["is_weight"] = (weight * m).sum()
            stats["is_truncated"] = ((raw > is_cap).float() * m).sum()
            stats["is_max"] = (raw * m).max() if mask.any() else lp.new_zeros(())
        if old_lp is None:
            stats["old_lp"] = old
    return loss, stats
