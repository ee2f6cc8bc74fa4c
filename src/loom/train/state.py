"""The resumable parts of a run that are not already Stateful (the loader and torch's GradScaler are), each
behind `state_dict()` / `load_state_dict(sd)`, so that the checkpointer saves and loads them without knowing
what they are (as torchtitan's checkpointer and torch.distributed.checkpoint.stateful.Stateful)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from loom import device as dev


class Stateful(Protocol):
    """What the checkpointer asks of every part it saves (the shape of torch.distributed.checkpoint's
    Stateful, declared here so that importing it does not import DCP)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """The loop's own progress: the number of optimizer steps taken (state.json's "step")."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class RngState:
    """The random streams a resumed run must continue (dropout's): the CPU generator and, on a GPU, the
    device's ("rng_cpu", "rng_cuda" of extra.pt)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        sd = {"rng_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":  # the key names the type: a run saved on a GPU resumes on a CPU
            sd["rng_cuda"] = dev.get_rng_state(self.device)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["rng_cpu"])
        if self.device.type == "cuda" and "rng_cuda" in state_dict:  # a CPU-saved run has none
            dev.set_rng_state(self.device, state_dict["rng_cuda"])


class ModelOptimState:
    """The model and its optimizer as one part: their state is laid out by the parallel layout, which alone
    knows how its pieces map to single-device names (`parallel`: loom.parallel's Parallelized)."""

    def __init__(self, parallel, optimizer: torch.optim.Optimizer):
        self.parallel, self.optimizer = parallel, optimizer

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optim"}: this rank's pieces under single-device names, for DCP (nothing gathered)."""
        model_sd, optim_sd = self.parallel.sharded_state(self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """{"model", "optim"}: either DCP folders (format 2, written under any layout: each rank reads the
        pieces it holds) or whole tensors by single-device name (format 1, sliced onto this rank's pieces)."""
        model, optim = state_dict["model"], state_dict["optim"]
        if isinstance(model, Path):
            self.parallel.load_sharded(self.optimizer, model, optim)
        else:
            self.parallel.load_model_state(model)
            self.parallel.load_optim_state(self.optimizer, optim)
