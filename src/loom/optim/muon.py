"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the 2-D hidden matrices; AdamW for the rest.

Muon (Keller Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks"; the optimizer of
the modded-nanogpt speedrun) keeps SGD's Nesterov momentum M of a weight matrix W and steps along the
orthogonal factor of M: for M = U S V^T it applies U V^T, every singular direction with the same size.
U V^T is approximated by a few steps of the quintic Newton-Schulz iteration

    X <- a X + (b A + c A^2) X,   A = X X^T,   (a, b, c) = (3.4445, -4.7750, 2.0315)

from X = M / ||M||_F (so every singular value starts in (0, 1]). The coefficients trade exactness for speed:
five steps take every singular value from about 1e-3 into [~0.7, ~1.2] rather than converging to 1, which
training does not mind. Embeddings, the output head, norms and biases are not hidden matrices and keep AdamW.

One optimizer holds both kinds of group (`use_muon` per group), so the trainer, the LR schedule and the
checkpoints (torch's state_dict: `momentum_buffer` per Muon parameter, `exp_avg`, `exp_avg_sq`, `step` per
AdamW parameter) see an ordinary torch optimizer.

Distributed parameters. With DDP every rank runs the same step on the same (all-reduced) gradients; ZeRO-1
hands whole parameters to ranks, so each rank orthogonalises the matrices it owns and ZeRO broadcasts them.
FSDP/ZeRO-2 and tensor parallel hold DTensor shards, but Newton-Schulz needs the whole matrix: the momentum
stays sharded (it is elementwise), the Nesterov update is all-gathered (`full_tensor`), every rank of the
parameter's mesh orthogonalises the same whole matrix, and keeps its own shard of the result (a Replicate ->
Shard redistribute is a local slice, no communication). That is one all-gather per matrix per step and
redundant compute, chosen over round-robin ownership (one rank orthogonalises, then broadcasts) because it
is exact by construction on any mesh (FSDP, TP, 2-D), needs no schedule across parameters, and on the small
matrices loom trains on CPUs the gather costs less than a broadcast round.
"""

from __future__ import annotations

import math

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """An approximation of U V^T for g = U S V^T (a matrix, or a batch of them: (..., m, n)), by the quintic
    Newton-Schulz iteration computed in `dtype` (fp32; bf16 as Keller Jordan's reference computes it).

    A wide matrix is iterated as is and a tall one transposed, so X X^T is the smaller Gram matrix."""
    assert g.dim() >= 2, "Newton-Schulz orthogonalises matrices"
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)  # singular values into (0, 1]: the iteration's basin
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(g.dtype)


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """newton_schulz of a plain tensor, or of a DTensor's whole matrix handed back as the same layout."""
    if not _is_dtensor(update):
        return newton_schulz(update, steps, dtype=dtype)
    from torch.distributed.tensor import DTensor, Replicate

    mesh = update.device_mesh
    whole = newton_schulz(update.full_tensor(), steps, dtype=dtype)  # every rank: the same matrix and result
    rep = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, update.placements)  # Replicate -> Shard: each rank slices its piece


class Muon(torch.optim.Optimizer):
    """Muon for groups with use_muon=True, AdamW for the others.

    Every group's step size is lr * lr_scale: the schedule writes `lr` (the AdamW learning rate) into every
    group, and a Muon group's lr_scale is muon_lr / lr, so both follow one schedule. A Muon step on an
    (m, n) matrix is scaled by sqrt(max(1, m / n)) (tall matrices get a larger step, as in Keller Jordan's
    implementation) and decoupled weight decay multiplies the weights by 1 - lr * weight_decay.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        lr_scale: float = 1.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        use_muon: bool = False,
        ns_dtype: str = "fp32",
    ):
        defaults = dict(
            lr=lr,
            lr_scale=lr_scale,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            use_muon=use_muon,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D matrices only (embeddings and vectors go to AdamW)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon(group)
            else:
                self._adamw(group)
        return loss

    def _muon(self, group: dict) -> None:
        lr, mom = group["lr"] * group["lr_scale"], group["momentum"]
        updates = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mom).add_(p.grad)
            updates[p] = p.grad.add(buf, alpha=mom) if group["nesterov"] else buf
        for p, o in self._orthogonalized(updates, group["ns_steps"], group.get("ns_dtype", "fp32")).items():
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(o, alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))

    @staticmethod
    def _orthogonalized(updates: dict, steps: int, ns_dtype: str) -> dict:
        """Each update orthogonalised. ns_dtype=bf16: in bf16, and the plain (not DTensor) matrices of one shape
        as one batch (a step's small matrices are each a few kernel calls otherwise: on a CPU the batch in bf16
        takes a third of the matrix-at-a-time fp32 time); fp32: one matrix at a time, in fp32."""
        if ns_dtype != "bf16":
            return {p: orthogonalize(u, steps) for p, u in updates.items()}
        out, by_shape = {}, {}
        for p, u in updates.items():
            if _is_dtensor(u):
                out[p] = orthogonalize(u, steps, torch.bfloat16)
            else:
                by_shape.setdefault((tuple(u.shape), u.dtype, u.device), []).append(p)
        for ps in by_shape.values():
            batch = newton_schulz(torch.stack([updates[p] for p in ps]), steps, dtype=torch.bfloat16)
            out.update(zip(ps, batch.unbind(0), strict=True))
        return out

    def _adamw(self, group: dict) -> None:
        lr, (b1, b2), eps = group["lr"] * group["lr_scale"], group["betas"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            t = state["step"].item()
            g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            p.mul_(1 - lr * group["weight_decay"])
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**t))
