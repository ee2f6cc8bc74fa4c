"""The optimizer of a run: AdamW (decoupled weight decay on >=2-D parameters only, with the implementation
switch) or Muon for the hidden matrices with AdamW for everything else (optim.name)."""

from __future__ import annotations

import functools

import torch

from loom.errors import LoomError
from loom.model.mup import lr_multipliers


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices and embeddings decay; biases and LayerNorm gains do not (nanogpt, gpt3 practice)."""
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return _nonempty(_split_lr_mult(groups, lr_multipliers(model)))


def _split_lr_mult(groups: list[dict], mults: dict[int, float]) -> list[dict]:
    """μP (model.mup, loom.model.mup): each group split by its parameters' learning-rate multiplier, each part
    with "lr_mult" (the trainer's schedule sets lr * lr_mult); unchanged without μP. A Muon group keeps its
    parameters together (Muon's step is already width-independent: loom.model.mup's docstring)."""
    if not mults:
        return groups
    out = []
    for g in groups:
        if g.get("use_muon"):
            out.append(g)
            continue
        by_mult: dict[float, list] = {}
        for p in g["params"]:
            by_mult.setdefault(mults.get(id(p), 1.0), []).append(p)
        out.extend({**g, "params": ps, "lr_mult": mult} for mult, ps in by_mult.items())
    return out


def is_hidden_matrix(module: torch.nn.Module, name: str, p: torch.nn.Parameter) -> bool:
    """A 2-D weight of a Linear layer that is not the output head: what Muon orthogonalises. Embeddings (a
    lookup, not a map between hidden spaces), the head (its rows are per-token outputs), norms and biases
    keep AdamW, as in modded-nanogpt."""
    return isinstance(module, torch.nn.Linear) and name == "weight" and p.dim() == 2


def muon_param_groups(model: torch.nn.Module, ocfg) -> list[dict]:
    """[Muon group, AdamW decay group, AdamW no-decay group], the empty ones left out; tied weights appear once (in the first group
    that meets them in module order; a tied embedding/head is an Embedding first, so AdamW)."""
    seen, muon, decay, no_decay = set(), [], [], []
    for mod_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            head = mod_name.split(".")[-1] == "lm_head"
            if is_hidden_matrix(module, name, p) and not head:
                muon.append(p)
            else:
                (decay if p.dim() >= 2 else no_decay).append(p)
    scale = ocfg.muon_lr / ocfg.lr  # Muon's step follows the same schedule as AdamW's lr
    groups = [
        {"params": muon, "use_muon": True, "lr_scale": scale, "weight_decay": ocfg.muon_weight_decay},
        {"params": decay, "use_muon": False, "lr_scale": 1.0, "weight_decay": ocfg.weight_decay},
        {"params": no_decay, "use_muon": False, "lr_scale": 1.0, "weight_decay": 0.0},
    ]
    return _nonempty(_split_lr_mult(groups, lr_multipliers(model)))


def _nonempty(groups: list[dict]) -> list[dict]:
    """The groups that hold parameters. An empty one (a LoRA run trains no norm gain, and under Muon no
    hidden matrix: the adapters are AdamW's) has no parameter to name its options by in a flattened optimizer
    state dict (torch.distributed.checkpoint), so a checkpoint of it could not be loaded: left out."""
    return [g for g in groups if g["params"]]


def muon_defaults(ocfg) -> dict:
    """Muon's constructor arguments from an OptimConfig (per-group values come from muon_param_groups)."""
    return dict(
        lr=ocfg.lr,
        momentum=ocfg.muon_momentum,
        ns_steps=ocfg.muon_ns_steps,
        ns_dtype=ocfg.muon_ns_dtype,
        betas=(ocfg.beta1, ocfg.beta2),
        eps=ocfg.eps,
    )


def resolve_impl(impl: str, device: torch.device) -> str:
    """auto picks torch's fused AdamW (CPU and CUDA have it), else foreach."""
    if impl == "auto":
        return "torch-fused" if device.type in ("cpu", "cuda", "mps") else "torch-foreach"
    return impl


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer for `cfg.optim` (an OptimConfig); lr is set per step by the schedule."""
    if cfg.name == "muon":
        from loom.optim.muon import Muon

        return Muon(muon_param_groups(model, cfg), **muon_defaults(cfg))
    impl = resolve_impl(cfg.impl, device)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    groups = param_groups(model, cfg.weight_decay)
    if getattr(cfg, "state_dtype", ""):
        return build_low_bit(groups, cfg.state_dtype, kwargs)
    if getattr(cfg, "offload", "none") != "none":
        return build_offload(groups, device, kwargs)
    if impl == "torch-fused":
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    if impl == "torch-foreach":
        return torch.optim.AdamW(groups, foreach=True, **kwargs)
    if impl == "torch-loop":
        return torch.optim.AdamW(groups, foreach=False, fused=False, **kwargs)
    if impl == "triton":  # one fused kernel launch per step for all parameters (needs loom[triton])
        from loom.optim.triton_adamw import TritonAdamW

        return TritonAdamW(groups, **kwargs)
    raise LoomError(
        f"unknown optim.impl '{impl}'", hint="use auto, torch-fused, torch-foreach, torch-loop or triton"
    )


_TORCHAO = "install torchao: pip install -e '.[fp8]' (the fp8 extra carries it)"


def build_low_bit(groups: list[dict], state_dtype: str, kwargs: dict) -> torch.optim.Optimizer:
    """optim.state_dtype=int8|int4: torchao's AdamW8bit / AdamW4bit (Dettmers et al. 2022; Li et al. 2023),
    each moment block-wise quantized (blocks of 256 values for int8, 128 for int4) in tensors of 4,096 values
    or more whose size the block divides; smaller tensors keep full-precision moments. The step is torchao's
    compiled kernel, on any device torch.compile serves (CPU included). loom's schedule sets each group's lr as
    a float; torchao keeps it a tensor (no recompile per value): LowBitAdamW converts around each step."""
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError:
        raise LoomError(
            f"optim.state_dtype={state_dtype} needs torchao's low-bit AdamW", hint=_TORCHAO
        ) from None
    base = {"int8": AdamW8bit, "int4": AdamW4bit}.get(state_dtype)
    if base is None:
        raise LoomError(f"unknown optim.state_dtype '{state_dtype}'", hint="leave it empty, or int8 | int4")
    return _lr_as_float(base)(groups, **kwargs)


@functools.cache  # one subclass per torchao class
def _lr_as_float(base: type) -> type:
    def step(self, closure=None):
        for g in self.param_groups:
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32)
        try:
            return base.step(self, closure)
        finally:  # the schedule and the logs read and write a float
            for g in self.param_groups:
                g["lr"] = float(g["lr"])

    def add_param_group(self, group: dict) -> None:
        base.add_param_group(self, group)
        self.param_groups[-1]["lr"] = float(self.param_groups[-1]["lr"])

    return type(f"LowBit{base.__name__}", (base,), {"step": step, "add_param_group": add_param_group})


def build_offload(groups: list[dict], device: torch.device, kwargs: dict) -> torch.optim.Optimizer:
    """optim.offload=cpu: torchao's CPUOffloadOptimizer, a torch AdamW on host copies of the parameters (its
    moments there too); each step copies the gradients to the host, steps there and copies the parameters back,
    overlapped with the backward on a CUDA stream. torchao serves CUDA and XPU parameters only: a CPU device
    (where the state is on the host already) is refused."""
    if device.type not in ("cuda", "xpu"):
        raise LoomError(
            f"optim.offload=cpu moves the optimizer state from a GPU to the host; this run's device is "
            f"{device.type}, where the state is in host memory already (torchao's CPUOffloadOptimizer serves "
            "CUDA and XPU parameters only)",
            hint="leave optim.offload=none on a CPU (optim.state_dtype=int8 shrinks the state there)",
        )
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        raise LoomError("optim.offload=cpu needs torchao's CPUOffloadOptimizer", hint=_TORCHAO) from None
    return CPUOffloadOptimizer(groups, torch.optim.AdamW, fused=True, **kwargs)
