"""LoRA adapters (Hu et al. 2021) added to a model's linears from outside, names unchanged.

An adapted linear computes  y = x W^T + b + scaling * (dropout(x) A^T) B^T  with W (out, in) frozen, A (rank, in)
and B (out, rank) trained, scaling = alpha / rank. A starts kaiming-uniform (nn.Linear's default, as in the
paper's loralib and peft) and B at zero, so an adapted model starts as the base model exactly.

Why loom has its own rather than peft: peft replaces each target by a `lora.Linear` that holds the original as
`base_layer` and its adapters as ModuleDicts keyed by adapter name, and wraps the model in a `PeftModel`. The
weight `blocks.0.attn.q_proj.weight` becomes `base_model.model.blocks.0.attn.q_proj.base_layer.weight` and the
module at `blocks.0.attn.q_proj` is no longer an nn.Linear. loom keys everything by the single-device names:
the tensor-parallel plan (`ColwiseParallel` on `blocks.0.attn.q_proj` accepts only an nn.Linear or an
nn.Embedding), the per-name seeded meta-device init, checkpoints, resharding and the transformers export
mapping. FSDP2's per-block `fully_shard` itself would work either way (a block stays the unit); the names are
what would not. Here the target stays the same nn.Linear instance: its class becomes a subclass (LoRALinear)
whose forward adds the low-rank path, and `lora_A` / `lora_B` are two more parameters of it, so the state
dict is the base model's plus `<linear>.lora_A` and `<linear>.lora_B`, and every style and wrapper that
takes an nn.Linear takes it.

Building on the meta device: apply_lora makes the adapters on the weights' device; a meta model gets its values
when loom.parallel materializes it, through init_lora_param (the model's init_param hands it the names ending
in lora_A / lora_B), seeded by (seed, name) as GPT.init_param is, so every layout starts from the same
adapters as one process.

Tensor parallel (the styles live with the plan, in a *_parallel.py file: the model never imports
torch.distributed). torch's ColwiseParallel shards every parameter of a linear Shard(0), A (rank, in) too,
which splits the rank; RowwiseParallel shards weight and bias and replicates the rest. DTensor computes the
right values either way; Megatron's layout (peft's LoRA for Megatron does the same) needs no communication of
its own beyond the base linear's:
  colwise, W Shard(0) over out:  A Replicate (the input is whole), B Shard(0) (this rank's output columns);
                                 A's gradient is a partial sum over the ranks (align_grads reduces it)
  rowwise, W Shard(1) over in:   A Shard(1) (the input arrives split over in), B Replicate: x A^T is a
                                 partial sum, reduced with the base output by the style's all-reduce
"""

from __future__ import annotations

import math
import re
import zlib
from fnmatch import fnmatchcase

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.errors import LoomError

LORA_SUFFIXES = (".lora_A", ".lora_B")
# Shorthands: the linears under the attention or MLP sub-modules (a MoE router excluded: it picks experts, and
# moving it moves tokens between experts the adapters do not touch; name it to adapt it), or every linear.
SHORTHANDS = ("attn", "mlp", "all-linear")
HEAD = "lm_head"  # the output head: adapted only when named (by its name or its full path, no wildcard)
# A MoE router (loom.model.moe) is never adapted: routing reads its weight in fp32 (MoE.route), not through its
# forward, so adapters there would never train (and DDP would stop on their missing gradients).
ROUTER = "router"


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank update: base(x) + scaling * (dropout(x) A^T) B^T. Instances are made by
    apply_lora from existing linears (their class swapped), never constructed."""

    base_cls: type[nn.Linear] = nn.Linear  # the class merge_lora restores
    lora_A: nn.Parameter  # (rank, in_features)
    lora_B: nn.Parameter  # (out_features, rank)
    lora_scaling: float  # alpha / rank
    lora_dropout: float  # dropout probability on the adapter's input (training only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # the base class's forward: nn.Linear's, or a subclass's (the LM head's mask)
        h = F.dropout(x, self.lora_dropout, training=True) if self.training and self.lora_dropout else x
        # (B, T, in) -> (B, T, rank), scaled there (rank values per token, not out), -> (B, T, out)
        return y + F.linear(F.linear(h, self.lora_A) * self.lora_scaling, self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.lora_A.shape[0]}, lora_scaling={self.lora_scaling:g}"


_SUBCLASSES: dict[type, type] = {nn.Linear: LoRALinear}


def lora_class(cls: type[nn.Linear]) -> type[LoRALinear]:
    """The LoRA class for a linear of class `cls`: LoRALinear for nn.Linear, else one made (once) on top of
    the subclass so its own forward still runs (the LM head's padding mask)."""
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRALinear, cls), {"base_cls": cls})
    return _SUBCLASSES[cls]


def lora_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name` (GPT.init_param's rule: independent of order and layout)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


@torch.no_grad()
def init_lora_param(name: str, t: torch.Tensor, seed: int) -> None:
    """Fill t, the whole adapter tensor `name` (ending in lora_A or lora_B), with its initial values:
    A (rank, in) uniform in +-1/sqrt(in), which is kaiming_uniform_(a=sqrt(5)), nn.Linear's default, from a
    generator seeded by (seed, name); B zeros (the adapted model starts as the base model)."""
    if name.endswith("lora_B"):
        t.zero_()
    elif name.endswith("lora_A"):
        bound = 1.0 / math.sqrt(t.shape[1])
        g = torch.Generator(device=t.device).manual_seed(lora_seed(seed, name))
        t.uniform_(-bound, bound, generator=g)
    else:
        raise ValueError(f"{name} is not a LoRA parameter")


def is_lora_name(name: str) -> bool:
    return name.endswith(LORA_SUFFIXES)


def _split_targets(targets: str | list[str]) -> list[str]:
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    return [t.strip() for t in items if t.strip()]


def _matches(name: str, target: str) -> bool:
    """Does the linear `name` match `target`: a shorthand, a last name component ("q_proj"), a dotted suffix
    ("attn.q_proj") or an fnmatch pattern over the whole name ("blocks.*.attn.q_proj")?"""
    parts = name.split(".")
    if target == HEAD or name == target:  # named explicitly (the head only this way)
        return name == target or parts[-1] == target
    if parts[-1] == HEAD:
        return False
    if target == "all-linear":
        return True
    if target in ("attn", "mlp"):
        return target in parts[:-1]
    return fnmatchcase(name, target) or fnmatchcase(name, "*." + target)


def _patterns(names: list[str]) -> list[str]:
    """Names with layer indices as '*', each once: 'blocks.*.attn.q_proj' for every block's."""
    seen: dict[str, None] = {}
    for n in names:
        seen[re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n)] = None
    return list(seen)


def _shared(model: nn.Module, linear: nn.Linear) -> bool:
    """Is the linear's weight also another module's (a head tied to the embedding)?"""
    return any(
        p is linear.weight for m in model.modules() if m is not linear for p in m.parameters(recurse=False)
    )


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    targets: str | list[str],
    dropout: float = 0.0,
    seed: int | None = None,
) -> list[str]:
    """Add LoRA adapters to every nn.Linear of `model` matched by `targets` and freeze everything else;
    return the names adapted, in module order.

    targets: a comma-separated string or a list; each one a last name component ("q_proj,v_proj"), a dotted
    suffix ("mlp.up_proj"), an fnmatch pattern over the whole name ("blocks.*.attn.q_proj"), or a shorthand:
    "attn", "mlp" (every linear under those sub-modules) or "all-linear"; never a MoE router (ROUTER). The head
    (lm_head) is adapted only when named, and not when tied to the embedding. Every target must match.
    Every parameter that is not an adapter gets requires_grad False: embeddings, norms, the head included.
    seed: the adapters' init seed (init_lora_param); None follows torch.manual_seed. A meta model's adapters
    stay uninitialised until materialized (the model's init_param then delegates to init_lora_param).
    """
    if rank < 1:
        raise LoomError(f"the LoRA rank must be >= 1; got {rank}", hint="set finetune.lora_rank=8, say")
    if not 0.0 <= dropout < 1.0:
        raise LoomError(f"the LoRA dropout must be in [0, 1); got {dropout}")
    wanted = _split_targets(targets)
    if not wanted:
        raise LoomError(
            "no LoRA targets given", hint="e.g. finetune.lora_targets=q_proj,v_proj or all-linear"
        )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    routers = [n for n in linears if n.split(".")[-1] == ROUTER]
    linears = {n: m for n, m in linears.items() if n not in routers}
    for t in wanted:  # a target naming only routers is refused; one that also names other linears skips them
        if not any(_matches(n, t) for n in linears) and any(_matches(n, t) for n in routers):
            raise LoomError(
                f"LoRA target '{t}' is a MoE router: routing reads its weight in fp32, not through its "
                "forward, so adapters there would never train",
                hint="leave the router out of finetune.lora_targets (all-linear, attn and mlp skip it)",
            )
    hint = "the model's linears: " + ", ".join(_patterns(list(linears))) + "; or attn, mlp, all-linear"
    for t in wanted:
        if not any(_matches(n, t) for n in linears):
            raise LoomError(f"LoRA target '{t}' matches no linear of the model", hint=hint)
    chosen = [n for n in linears if any(_matches(n, t) for t in wanted)]
    for n in chosen:
        m = linears[n]
        if isinstance(m, LoRALinear):
            raise LoomError(f"{n} already has LoRA adapters", hint="apply_lora once per model")
        if _shared(model, m):
            raise LoomError(
                f"{n}'s weight is shared with another module (a head tied to the embedding): merging an "
                "adapter into it would change both",
                hint="leave lm_head out of the LoRA targets",
            )
    for p in model.parameters():
        p.requires_grad_(False)
    if seed is None and chosen and not linears[chosen[0]].weight.is_meta:
        seed = int(torch.randint(2**62, ()))
    for n in chosen:
        _adapt(linears[n], n, rank, alpha, dropout, seed)
    return chosen


def check_rank(model: nn.Module) -> None:
    """Refuse adapters whose rank is above min(in, out) of an adapted linear: B A (out, in) cannot have a rank
    above that, so the extra rank only adds parameters (rank 100,000 on a 32-wide model trained 25.6M
    parameters for a 47k model) and memory, never expressiveness. Checked before training (loom.train's
    check_lora_targets), not when a trained run is loaded: a run made before the rule still loads."""
    chosen = lora_modules(model)
    if not chosen:
        return
    rank = next(iter(chosen.values())).lora_A.shape[0]
    name = min(chosen, key=lambda n: min(chosen[n].in_features, chosen[n].out_features))
    m = chosen[name]
    most = min(m.in_features, m.out_features)
    if rank > most:
        raise LoomError(
            f"finetune.lora_rank={rank} is above {most}, the smallest width of the adapted linears ({name}: "
            f"{m.in_features} in, {m.out_features} out): a rank that large is no low-rank adapter (B A cannot "
            f"exceed rank {most}) and trains more parameters than the linears it adapts",
            hint=f"set finetune.lora_rank to at most {most} (8 to 64 are usual), or fine-tune every parameter "
            "with finetune.lora_rank=0",
        )


def apply_configured(model: nn.Module, finetune, seed: int | None = None) -> list[str]:
    """apply_lora with a run's finetune.lora_* keys (loom.config.FinetuneConfig); nothing when lora_rank is 0."""
    f = finetune
    if not f.lora_rank:
        return []
    return apply_lora(model, f.lora_rank, f.lora_alpha, f.lora_targets, f.lora_dropout, seed=seed)


def _adapt(m: nn.Linear, name: str, rank: int, alpha: float, dropout: float, seed: int | None) -> None:
    w = m.weight
    kw = {"device": w.device, "dtype": w.dtype}
    m.lora_A = nn.Parameter(torch.empty(rank, m.in_features, **kw))
    m.lora_B = nn.Parameter(torch.empty(m.out_features, rank, **kw))
    m.lora_scaling = alpha / rank
    m.lora_dropout = dropout
    m.__class__ = lora_class(type(m))
    if not w.is_meta:
        init_lora_param(f"{name}.lora_A", m.lora_A.data, seed)
        init_lora_param(f"{name}.lora_B", m.lora_B.data, seed)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_scaling(model: nn.Module) -> float | None:
    """alpha / rank of the model's adapters (apply_lora gives all one value), None without adapters: what
    merge_lora_state needs for a whole state dict gathered from a parallel layout."""
    return next((m.lora_scaling for m in lora_modules(model).values()), None)


def delta_weight(m: LoRALinear) -> torch.Tensor:
    """scaling * B @ A (out, in), computed in fp32 at least."""
    dtype = torch.promote_types(m.lora_B.dtype, torch.float32)
    return (m.lora_B.to(dtype) @ m.lora_A.to(dtype)) * m.lora_scaling


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its weight (W += scaling * B @ A), drop lora_A / lora_B and restore each
    linear's class: the model then has exactly the base model's parameter names (before an HF export).
    requires_grad is left as it is (frozen). Returns the names merged."""
    from loom.model.nf4 import dequantized, is_nf4

    merged = lora_modules(model)
    for m in merged.values():
        if is_nf4(m.weight):  # a QLoRA base: the merged weight is the dequantized base plus the update, plain
            w = dequantized(m.weight)
            m.weight = nn.Parameter((w.float() + delta_weight(m)).to(w.dtype), requires_grad=False)
        else:
            m.weight.copy_(m.weight.to(torch.promote_types(m.weight.dtype, torch.float32)) + delta_weight(m))
        del m.lora_A, m.lora_B, m.lora_scaling, m.lora_dropout
        m.__class__ = type(m).base_cls
    return list(merged)


@torch.no_grad()
def merge_lora_state(sd: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict with its adapters folded in, without a model: for each '<linear>.lora_A' / '.lora_B' pair,
    '<linear>.weight' += scaling * B @ A (fp32 math, the weight's dtype kept); the lora keys dropped. `scaling`:
    alpha / rank of the run (finetune.lora_alpha / finetune.lora_rank). sd itself is not changed. An NF4 weight
    (QLoRA, gathered from FSDP) merges as its dequantized values, a plain tensor."""
    from loom.model.nf4 import dequantized

    out = {k: v for k, v in sd.items() if not is_lora_name(k)}
    for k in sd:
        if k.endswith(".lora_A"):
            base = k[: -len(".lora_A")]
            a, b, w = sd[k].float(), sd[base + ".lora_B"].float(), dequantized(sd[base + ".weight"])
            out[base + ".weight"] = (w.float() + scaling * (b @ a)).to(w.dtype)
    return out


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors, by their names in `model` (an adapter-only checkpoint: rank*(in+out) per
    adapted linear instead of the whole model)."""
    return {k: v for k, v in model.state_dict().items() if is_lora_name(k)}


def count_trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts, a tied tensor once."""
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    return sum(p.numel() for p in seen.values() if p.requires_grad), total


def trainable_summary(model: nn.Module) -> str:
    """'trainable 12,288 of 1,234,567 parameters (1.00%)', for the run's log."""
    trainable, total = count_trainable(model)
    return f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
