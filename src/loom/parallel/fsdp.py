"""Sharded data parallelism with FSDP2 (`fully_shard`): ZeRO-2 and ZeRO-3.

`fully_shard` is applied to every transformer block and then to the root (which holds the embeddings, the
final norm and the tied head), as torchtitan does: each block's parameters are all-gathered just before
its forward/backward and its gradients reduce-scattered just after, so only one block is ever whole.
ZeRO-3 (`fsdp`) frees the gathered parameters after forward (reshard_after_forward=True); ZeRO-2
(`zero2`) keeps them until backward, trading memory for one all-gather less (Rajbhandari et al., 2020).

Checkpoints go through torch.distributed.checkpoint's state-dict API with full_state_dict=True: rank 0
receives the full, unsharded model and optimizer state (in torch's ordinary formats), so a run saved at one
world size or implementation resumes at any other and `loom generate` reads it as usual.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from loom import log
from loom.errors import LoomError
from loom.parallel.ddp import TorchDDP

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "": None}


class TorchFSDP(TorchDDP):
    sharded = True

    def __init__(self, rank: int, size: int, device: torch.device, reshard_after_forward: bool,
                 param_dtype: str = "", reduce_dtype: str = "", cpu_offload: bool = False):  # fmt: skip
        super().__init__(rank, size, device)
        self.reshard_after_forward = reshard_after_forward
        for name, d in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if d not in DTYPES:
                raise LoomError(f"parallel.{name} must be one of fp32, bf16, fp16 or empty; got '{d}'")
        if param_dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise LoomError("parallel.param_dtype=bf16 but this GPU cannot run bf16", hint="use fp16 or fp32")
        self.param_dtype, self.reduce_dtype = DTYPES[param_dtype], DTYPES[reduce_dtype]
        self.cpu_offload = cpu_offload
        if cpu_offload and device.type == "cpu":
            log.warn("parallel.cpu_offload has no effect on a CPU device; ignored")
            self.cpu_offload = False

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.size,), mesh_dim_names=("dp",))
        kwargs = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
        }
        if self.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def build_optimizer(self, model, ocfg, device):
        # fused AdamW does not take DTensor parameters on every device; foreach does.
        if ocfg.impl in ("auto", "torch-fused"):
            from dataclasses import replace

            ocfg = replace(ocfg, impl="torch-foreach")
        return super().build_optimizer(model, ocfg, device)

    def no_sync(self, model, skip: bool):
        model.set_requires_gradient_sync(not skip)
        return super().no_sync(model, False)

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Every rank initialised (or loaded) the same weights before sharding: nothing to send."""

    def model_state(self, model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_model_state(self, model, sd):
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))

    def optim_state(self, model, opt):
        fqn_sd = get_optimizer_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return to_index_keys(fqn_sd, model, opt) if fqn_sd else {}

    def load_optim_state(self, model, opt, sd):
        set_optimizer_state_dict(
            model, opt, to_fqn_keys(sd, model, opt), options=StateDictOptions(full_state_dict=True)
        )


def _names_in_optimizer_order(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def to_index_keys(fqn_sd: dict, model, opt) -> dict:
    """DCP's name-keyed optimizer state -> torch's index-keyed format (what a plain AdamW saves)."""
    order = _names_in_optimizer_order(model, opt)
    index = {n: i for i, n in enumerate(order)}
    state = {index[n]: v for n, v in fqn_sd["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in fqn_sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def to_fqn_keys(sd: dict, model, opt) -> dict:
    order = _names_in_optimizer_order(model, opt)
    state = {order[i]: v for i, v in sd["state"].items()}
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}
