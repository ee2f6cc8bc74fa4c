"""What the dry run counts for torchao's memory savers: an NF4 base (finetune.quantize_base=nf4, QLoRA), low-bit
AdamW states (optim.state_dtype=int8|int4) and the optimizer offloaded to the host (optim.offload=cpu).

The fake-tensor step cannot run them as they are (an NF4Tensor's fake would count at its logical fp32 size;
torchao's low-bit step compiles; its offload needs a real GPU), so the rank is stepped with each of them off
(plain fp32 base linears, torch's AdamW on the device) and its held bytes are then rewritten from that rank's
own tensors, by the layouts' formulas:

- NF4: each quantized linear's local shard at loom.model.nf4.nf4_bytes (4-bit codes, an int8 scale per 64
  values, an fp32 factor per 16,384: 0.516 bytes a weight) instead of its fp32 bytes;
- int8 / int4: AdamW's two moments of each trainable tensor torchao quantizes (>= 4,096 values, a whole number
  of its blocks: 256 for int8, 128 for int4) at 1 or 0.5 bytes a value plus an fp32 scale a block (2.03 and
  1.06 bytes a parameter for both moments); smaller tensors keep fp32 moments (8 bytes), as torchao does;
- offload: no optimizer state on the device; the host holds the moments and an fp32 copy of each trainable
  parameter (12 bytes a parameter), reported as host bytes.

The rewritten terms are `params` and `optim` (held, and in every phase's peak). What is not rewritten, so an
upper bound for NF4: the activations (bf16 autocast saves a cast copy of each frozen fp32 base weight for
backward, where torchao's linear_nf4 saves the 4-bit weight and dequantizes again) and FSDP's gathered
blocks (counted at fp32, NF4 gathers its 4-bit shards).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch.nn as nn

from loom.config import Config

# torchao's low-bit AdamW: (bytes a moment value, values per fp32 scale); a tensor under MIN_QUANT values (or not
# a whole number of blocks) keeps fp32 moments (torchao.optim's _new_buffer)
LOW_BIT = {"int8": (1.0, 256), "int4": (0.5, 128)}
MIN_QUANT = 4096


def counted(cfg: Config) -> bool:
    """Does cfg ask for any of them?"""
    f, o = cfg.finetune, cfg.optim
    return f.quantize_base == "nf4" or bool(o.state_dtype) or o.offload != "none"


def stepped_config(cfg: Config) -> Config:
    """The config the fake step runs: cfg with the three off."""
    run = copy.deepcopy(cfg)
    run.finetune.quantize_base, run.optim.state_dtype, run.optim.offload = "none", "", "none"
    return run


def state_bytes(numel: int, state_dtype: str) -> float:
    """AdamW's two moments of one tensor of `numel` values (this rank's shard) in torchao's state dtype."""
    if state_dtype not in LOW_BIT or numel < MIN_QUANT or numel % LOW_BIT[state_dtype][1]:
        return 8.0 * numel
    per_value, block = LOW_BIT[state_dtype]
    return 2 * (per_value * numel + 4 * math.ceil(numel / block))


def deltas(model: nn.Module, cfg: Config) -> tuple[int, int, int]:
    """(params, optim, host) bytes to add to what the fake step of stepped_config(cfg) held on this rank."""
    from loom.model.nf4 import nf4_bytes, nf4_targets
    from loom.parallel.tensor import local

    d_params = d_optim = host = 0.0
    if cfg.finetune.quantize_base == "nf4":
        for m in nf4_targets(model).values():
            w = local(m.weight)
            d_params += nf4_bytes(w.numel()) - w.numel() * w.element_size()
    o = cfg.optim
    trained = [local(p) for p in {id(p): p for p in model.parameters() if p.requires_grad}.values()]
    for p in trained:
        n = p.numel()
        if o.offload != "none":
            d_optim -= 8.0 * n  # fp32 AdamW's two moments, measured on the device, go to the host
            host += 12.0 * n  # the moments and an fp32 copy of the parameter
        elif o.state_dtype:
            d_optim += state_bytes(n, o.state_dtype) - 8.0 * n
    return round(d_params), round(d_optim), round(host)


def rewrite(mem, model: nn.Module, cfg: Config):
    """The RankMemory `mem` of the fake step with cfg's NF4 base, low-bit states and offload counted."""
    d_params, d_optim, host = deltas(model, cfg)

    def shifted(terms: dict[str, int], optim: bool = True) -> dict[str, int]:
        d_o = d_optim if optim else 0
        return {
            **terms,
            "params": terms["params"] + d_params,
            "optim": terms["optim"] + d_o,
            "total": terms["total"] + d_params + d_o,
        }

    # every phase holds the base; the state (created by the first update) is in every phase of a steady step
    # (loom.dryrun.step._steady), the update's too
    phases = {name: shifted(ph) for name, ph in mem.phases.items()}
    return replace(
        mem,
        params=mem.params + d_params,
        optim=mem.optim + d_optim,
        phases=phases,
        tracked=shifted(mem.tracked),
        host_optim=host,
    )


def note(cfg: Config) -> str | None:
    """The report's line saying what was counted (None: nothing)."""
    if not counted(cfg):
        return None
    f, o = cfg.finetune, cfg.optim
    what = []
    if f.quantize_base == "nf4":
        what.append(
            "the NF4 base at 0.516 bytes a weight (activations and FSDP's gathered blocks as fp32's: an upper bound)"
        )
    if o.state_dtype:
        what.append(
            f"AdamW's {o.state_dtype} moments ({'2.03' if o.state_dtype == 'int8' else '1.06'} bytes a parameter)"
        )
    if o.offload != "none":
        what.append("the optimizer state on the host (12 bytes a trained parameter), none on the device")
    return "torchao   stepped without them, then counted (loom.dryrun.torchao_states): " + "; ".join(what)
