"""FP8 training through torchao (`precision.fp8 = tensorwise | rowwise`), applied from outside the model.

torchao's float8 training swaps chosen `nn.Linear`s for `Float8Linear`: each matmul of forward and backward
casts its two operands to float8 (e4m3, dynamically scaled: one scale per tensor, or per row for `rowwise`)
and runs `torch._scaled_mm`, while the weights, their gradients and the optimizer stay in high precision
(fp32 master weights). loom applies it in `parallelize` first, in torchtitan's order:

    float8 conversion -> tensor parallel (torchao's Float8 column/row-wise styles: tensorwise only)
    -> activation checkpointing -> compile -> FSDP with FP8 all-gather of the weights (tensorwise)

Under FSDP with `tensorwise`, each weight shard is cast to float8 before the all-gather (1 byte a value, a
quarter of fp32's), with one scale from the whole weight's absolute maximum: precomputed for every weight in
one all-reduce after each optimizer step (`precompute_scales`), so the float8 weight a rank gathers is the one
a single process casts. Rowwise keeps torchao's default: weights gathered in the parameter dtype.

Which linears (`select`): both dimensions multiples of 16 (what the float8 matmul requires), never the LM head
unless `precision.fp8_head=true` (the head's logits feed the loss directly, and peers keep it high precision
for that reason), and with `precision.fp8_filter=auto` not the small ones where the casts cost more than the
float8 matmul saves: the thresholds torchao measured on H100 (tensorwise: skip when in <= 4096 and
out <= 1024; rowwise: skip when out <= 2048, in <= 1024, or out <= 4096 and in <= 2048). `fp8_filter=all`
converts every linear that qualifies otherwise (small models, tests, CPU runs).

Evaluation, sampling and export run in high precision (`high_precision`): the converted linears compute a plain
`F.linear` in the autocast dtype. Where the layout already moved a tensor in float8 (the FSDP all-gather of a
weight, a Float8 TP style's input), that value is dequantized first: those layouts evaluate on weights rounded
to float8 once. Checkpoints hold the plain high-precision weights (the names do not change), so an fp8 run
resumes into bf16 and the other way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom import compat, log
from loom import device as dev
from loom.errors import LoomError
from loom.metrics import FP8_MIN_CAPABILITY


def require_torchao():
    """torchao's float8 module, or one clear error naming the extra."""
    # torchao logs each optional CUDA kernel library it cannot load (none exist in a CPU build) at import
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # and torch 2.13 warns once that torchao registers an Enum as a pytree constant (deprecated there)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise LoomError(
            f"precision.fp8 needs torchao, which cannot be imported ({e})",
            hint="install loom's fp8 extra: pip install 'loom[fp8]' (torchao >= 0.18), or precision.fp8=off",
        ) from e
    return float8


def check_device(fp8: str, device: torch.device) -> None:
    """A GPU without float8 tensor cores, before the model is built (a CPU emulates float8 matmuls: per-tensor
    scales from torch 2.11, per-row ones from 2.13)."""
    if fp8 == "rowwise" and device.type == "cpu" and _torch_version() < (2, 13):
        raise LoomError(
            f"precision.fp8=rowwise on a CPU needs torch 2.13 or later (torch {torch.__version__}'s CPU float8 "
            "matmul takes per-tensor scales only)",
            hint="use precision.fp8=tensorwise, or a newer torch",
        )
    if fp8 == "off" or device.type != "cuda":
        return
    cap = dev.capability(device)
    if cap < FP8_MIN_CAPABILITY:
        raise LoomError(
            f"precision.fp8={fp8}: this GPU ({dev.name(device)}, compute capability "
            f"{cap[0]}.{cap[1]}) has no float8 "
            "tensor cores (compute capability 8.9 or higher: L4, L40S, H100, H200, B200)",
            hint="use precision.fp8=off (bf16)",
        )


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def select(recipe: str, head: bool, filt: str):
    """The module filter: (module, name) -> whether to convert it (module docstring: the rule and why)."""

    def keep(mod: nn.Module, name: str) -> bool:
        if not isinstance(mod, nn.Linear):
            return False
        if name.split(".")[-1] == "lm_head" and not head:
            return False
        out, inp = mod.weight.shape
        if out % 16 or inp % 16:
            return False
        if filt == "all":
            return True
        if recipe == "tensorwise":
            return not (inp <= 4096 and out <= 1024)
        return not (out <= 2048 or inp <= 1024 or (out <= 4096 and inp <= 2048))

    return keep


def convert(model: nn.Module, pcfg, fsdp: bool) -> list[str]:
    """Swap the selected linears for torchao's Float8Linear, in place; the names converted. `fsdp`: the
    weights will be FSDP-sharded (tensorwise then all-gathers them in float8)."""
    float8 = require_torchao()
    compat.cpu_float8_matmul()  # on a CPU only: torch's float8 matmul there is a reference loop
    config = float8.Float8LinearConfig.from_recipe_name(pcfg.fp8)
    if pcfg.fp8 == "tensorwise" and fsdp:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    keep = select(pcfg.fp8, pcfg.fp8_head, pcfg.fp8_filter)
    names = [n for n, m in model.named_modules() if keep(m, n)]
    report(names, model, pcfg)
    # the model's own marks on its linears (GPT's residual_scale for init, the head's vocab_size), which the
    # swap would drop: a meta-built model is initialised after this, by name and by these marks
    marks = {n: _marks(model.get_submodule(n)) for n in names}
    head = model.lm_head  # every family has one (registry.FamilyModel)
    float8.convert_to_float8_training(
        model, module_filter_fn=lambda m, n: keep(m, n) and m is not head, config=config
    )
    if "lm_head" in names:  # a subclass of Float8Linear that keeps the head's padding mask
        model.lm_head = _float8_head(head, config)
    for n, extra in marks.items():
        mod = model.get_submodule(n)
        for k, v in extra.items():
            setattr(mod, k, v)
    return names


def report(names: list[str], model: nn.Module, pcfg) -> None:
    """Say how many linears run in float8, every time; refuse, with the remedy, when none would (fp8 asked
    and not given, silently, is the fault this prevents)."""
    total = sum(isinstance(m, nn.Linear) for m in model.modules())
    what = f"precision.fp8={pcfg.fp8} (fp8_filter={pcfg.fp8_filter})"
    if not names:
        if pcfg.fp8_filter == "auto":
            hint = (
                "the auto filter skips linears below torchao's H100 size thresholds (module docstring of "
                "loom.parallel.fp8): set precision.fp8_filter=all to convert them anyway, or precision.fp8=off"
            )
        else:
            hint = (
                "a float8 matmul needs both dimensions of a weight to be multiples of 16: choose widths that "
                "are (model.n_embd, the MLP's hidden size), or precision.fp8=off"
            )
        raise LoomError(f"{what} converts none of this model's {total} linear layers to float8", hint=hint)
    log.info(f"fp8: {len(names)} of {total} linear layers in float8 ({what})")


def _marks(mod: nn.Module) -> dict:
    plain = nn.Linear(1, 1, device="meta").__dict__
    return {k: v for k, v in mod.__dict__.items() if not k.startswith("_") and k not in plain}


def _float8_head(head: nn.Module, config) -> nn.Module:
    from torchao.float8.float8_linear import Float8Linear

    class Float8Head(Float8Linear):
        """Padding ids masked out of place: autograd forbids writing into the float8 matmul's output (its own
        Function), so this head holds one more logits-sized tensor than the plain one."""

        def forward(self, x):
            logits = super().forward(x)
            if not self.mask_padding:
                return logits
            pad = torch.arange(logits.size(-1), device=logits.device) >= self.vocab_size
            return logits.masked_fill(pad, torch.finfo(logits.dtype).min)

    return Float8Head.from_float(head, config=config)  # convert() copies vocab_size and mask_padding


def tp_styles(model: nn.Module, plan: dict, recipe: str) -> dict:
    """The family's TP plan with torchao's Float8 column/row-wise styles on the converted linears, so
    sequence parallel's all-gathers of their inputs move float8 (tensorwise only; rowwise keeps the plain
    styles, as torchtitan does). The head keeps the family's own style (it masks padded vocabulary rows)."""
    if recipe != "tensorwise":
        return plan
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    swap = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out = {}
    for path, style in plan.items():
        mod = model.get_submodule(path) if path else model
        if type(style) in swap and isinstance(mod, Float8Linear):
            style = copy.copy(style)
            style.__class__ = swap[type(style)]  # same constructor arguments and fields
        out[path] = style
    return out


def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step: every float8-gathered weight's scale in one all-reduce (a no-op without
    FSDP's float8 all-gather)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def _dequantized(t):
    """A float8 tensor (or a DTensor of one) back in its original precision; anything else as it is."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    if isinstance(t, Float8TrainingTensor):
        return t.to_original_precision()
    local = compat.local_tensor(t)
    if isinstance(local, Float8TrainingTensor):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local.to_original_precision(), t.device_mesh, t.placements, run_check=False)
    return t


def _high_precision_linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Float8Linear's plain linear (the head's with its padding mask, as the plain head does)."""
    out = F.linear(_dequantized(x), _dequantized(mod.weight), mod.bias)
    if getattr(mod, "mask_padding", False):
        from loom.model.vocab import mask_padding_

        mask_padding_(out, mod.vocab_size)
    return out


def _high_precision_forward(mod: nn.Module):
    """`mod`'s high-precision forward, bound once and kept: under torch.compile a new function at every
    evaluation would be a new guard and a recompilation each time (a bound method: a deep copy rebinds it)."""
    if "_loom_high_precision" not in mod.__dict__:
        mod.__dict__["_loom_high_precision"] = types.MethodType(_high_precision_linear, mod)
    return mod.__dict__["_loom_high_precision"]


@contextlib.contextmanager
def high_precision(model: nn.Module):
    """Within it, every Float8Linear of `model` computes a plain linear (module docstring)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:  # no torchao: nothing was converted
        yield
        return
    mods = [m for m in model.modules() if isinstance(m, Float8Linear)]
    for m in mods:
        m.forward = _high_precision_forward(m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward
