"""QLoRA's base (Dettmers et al. 2023): the frozen linears of a LoRA model held as torchao's NF4Tensor.

NF4 is 4-bit NormalFloat: each block of 64 weights is scaled by its absmax and each value rounded to the nearest
of 16 levels spaced as the quantiles of a normal distribution; "double quantization" stores those per-block
scales as int8, in blocks of 256 scales, with one fp32 factor per scale block and their mean. A weight of n
values costs n/2 bytes + n/64 (int8 scales) + 4n/16384 (fp32 factors): about 0.52 bytes a parameter, against
2 in bf16 and 4 in fp32. torchao's layout needs n divisible by 64 (a whole block) and n/64 divisible by 256 (a
whole block of scales): n a multiple of 16,384 (check_nf4 refuses the rest before any work).

What is quantized: every nn.Linear of the model but the head (lm_head: its rows are per-token outputs, and
bitsandbytes' QLoRA leaves it too) and a MoE router (routing reads its weight in fp32). The embedding, the norms
and the adapters keep the model's dtype. The adapters compute in the step's precision (autocast) as with bf16
LoRA. The forward of a quantized linear is torchao's linear_nf4 (through F.linear's torch-function override):
the weight is dequantized to the input's dtype for the matmul and again for the input gradient; the base
never gets a gradient.

torchao is optional (the loom[fp8] extra carries it): imported only inside these functions.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from loom.errors import LoomError

NF4_BLOCK = 64  # weights per absmax block (torchao's default, the QLoRA paper's)
NF4_SCALER_BLOCK = 256  # per-block scales per double-quantization block
NF4_MULTIPLE = NF4_BLOCK * NF4_SCALER_BLOCK  # a quantizable weight's size is a multiple of this (16,384)
NO_QUANT = ("lm_head", "router")  # last name components left in the model's dtype
_INSTALL = "install torchao: pip install -e '.[fp8]' (the fp8 extra carries it)"


def nf4_api():
    """torchao's (NF4Tensor, to_nf4), wherever this torchao version keeps them; a LoomError naming the extra
    when torchao is missing."""
    try:  # torchao >= 0.15
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    except ImportError:
        try:  # older torchao
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError:
            raise LoomError(
                "finetune.quantize_base=nf4 needs torchao's NF4Tensor, and torchao is not installed",
                hint=_INSTALL,
            ) from None
    return NF4Tensor, to_nf4


def is_nf4(t: torch.Tensor) -> bool:
    """Is t an NF4Tensor? (No torchao imported, no NF4 tensor exists: nothing is imported to answer.)"""
    if "torchao" not in sys.modules:
        return False
    return isinstance(t, nf4_api()[0])


def nf4_targets(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears quantize_base replaces the weight of: every nn.Linear but the head and a router."""
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.split(".")[-1] not in NO_QUANT
    }


def check_nf4(model: nn.Module, shards: int = 1) -> None:
    """Refuse, before any weight exists (shapes only: a meta model serves), a linear torchao's NF4 cannot hold:
    a weight whose size is not a multiple of 64 x 256 = 16,384 (whole absmax blocks, whole blocks of scales),
    or a weight that trains; with FSDP over `shards` ranks, a weight whose rows or whose blocks of scales the
    ranks cannot split evenly (torchao's NF4 split gives each rank whole rows and whole scale blocks, and its
    all-gather assumes equal shards: FSDP's padding of a short last shard is not served)."""
    for name, m in nf4_targets(model).items():
        w = m.weight
        if w.numel() % NF4_MULTIPLE:
            reason = (
                f"not a multiple of NF4's block size {NF4_BLOCK}"
                if w.numel() % NF4_BLOCK
                else f"{w.numel() // NF4_BLOCK:,} blocks of {NF4_BLOCK}, not a multiple of NF4's scaler block size "
                f"{NF4_SCALER_BLOCK}"
            )
            raise LoomError(
                f"finetune.quantize_base=nf4 cannot quantize {name}: its weight {tuple(w.shape)} has "
                f"{w.numel():,} values, {reason} (torchao's NF4 needs a multiple of {NF4_MULTIPLE:,})",
                hint="choose widths whose products are multiples of 16,384 (n_embd and the MLP width multiples of "
                "128, say), or fine-tune this model with finetune.quantize_base=none",
            )
        if w.requires_grad:
            raise LoomError(
                f"finetune.quantize_base=nf4: {name}'s weight trains, and an NF4 weight is frozen",
                hint="quantize_base=nf4 is for LoRA (finetune.lora_rank > 0), whose base is frozen",
            )
        scale_blocks = w.numel() // NF4_MULTIPLE
        if shards > 1 and (w.shape[0] % shards or scale_blocks % shards):
            raise LoomError(
                f"finetune.quantize_base=nf4 under FSDP over {shards} ranks cannot shard {name}: its weight "
                f"{tuple(w.shape)} has {w.shape[0]:,} rows and {scale_blocks:,} blocks of {NF4_MULTIPLE:,} values "
                f"(one fp32 scale factor each), and each rank must hold an equal share of both",
                hint=f"choose widths that give every quantized weight a multiple of {shards} x {NF4_MULTIPLE:,} "
                "values, or use fewer FSDP ranks (one process serves any NF4 weight)",
            )


@torch.no_grad()
def quantize_base(model: nn.Module) -> list[str]:
    """Replace each target linear's weight (frozen, real values on its device) by its NF4Tensor, one linear at a
    time, so the full-precision weight is freed as each is done; the names quantized."""
    check_nf4(model)
    _, to_nf4 = nf4_api()
    done = []
    for name, m in nf4_targets(model).items():
        if is_nf4(m.weight):
            continue
        q = to_nf4(m.weight.detach().contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)
        m.weight = nn.Parameter(q, requires_grad=False)
        done.append(name)
    return done


@torch.no_grad()
def nf4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w as its QLoRA run trained against it, a plain tensor of its dtype: NF4-quantized, then dequantized."""
    _, to_nf4 = nf4_api()
    return to_nf4(w.detach().contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK).get_original_weight()


def nf4_round_trip_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A QLoRA run's base state dict (by the names of `model`, the run's model) with each quantized linear's
    weight rounded through NF4 (nf4_round_trip): a run read back (eval, chat, export to hf) computes what
    training saw, and its adapters merge into ordinary weights."""
    out = dict(state)
    for name in nf4_targets(model):
        key = f"{name}.weight"
        if key in out:
            out[key] = nf4_round_trip(out[key])
    return out


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """An NF4 tensor's values as a plain tensor of its dtype (any other tensor as it is)."""
    return t.get_original_weight() if is_nf4(t) else t


def nf4_bytes(numel: int) -> float:
    """Bytes an NF4 weight of `numel` values holds: 4-bit codes, int8 scales per 64, an fp32 factor per 16,384."""
    return numel / 2 + numel / NF4_BLOCK + 4 * numel / NF4_MULTIPLE


@torch.no_grad()
def materialize_nf4(
    model: nn.Module,
    device: torch.device,
    init,
    aliases: dict[str, str],
    pretrained: dict[str, torch.Tensor] | None,
) -> list[str]:
    """QLoRA's base made on a meta-built LoRA model one module at a time: each module's own parameters
    allocated on `device`, given `pretrained`'s values (by single-device name) or `init(name, whole)`'s seeded
    ones, and a target linear's weight quantized to NF4 at once, so the model never holds more than one linear
    in full precision (and each pretrained linear's tensor is dropped from `pretrained` as it is used). The
    values are those loom.parallel.init.materialize and a load of `pretrained` give, then rounded through NF4:
    a one-process run and an FSDP run (whose fully_shard then splits the NF4 weights) start alike. The
    names quantized. Tied parameters come out untied (the caller reties them, as after materialize)."""
    _, to_nf4 = nf4_api()
    targets = {id(m) for m in nf4_targets(model).values()}
    done = []
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if not any(t.is_meta for _, t in own):
            continue
        module.to_empty(device=device, recurse=False)
        for pname, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            name = f"{prefix}.{pname}" if prefix else pname
            key = aliases.get(
                name, name
            )  # a tied alias: the one tensor's name (the model is not wrapped yet)
            if pretrained is not None and key in pretrained:
                # a target's weight is used once: dropped here, so the host copy shrinks as the model fills
                src = pretrained.pop(key) if id(module) in targets and pname == "weight" else pretrained[key]
                t.copy_(src.to(device=device, dtype=t.dtype))
            elif init is not None:
                init(key, t)
        if id(module) in targets:
            module.weight = nn.Parameter(
                to_nf4(module.weight.detach().contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False
            )
            done.append(prefix)
    return done
