"""The trainer's checkpoint component: what a checkpoint holds, saving it (every rank learns the outcome),
and loading it back into any layout."""

from __future__ import annotations

from pathlib import Path

import torch

from loom import __version__, checkpoint, log
from loom.config import Config
from loom.errors import LoomError


class Checkpointer:
    """Saves and loads the trainer's model, optimizer, loader, scaler, RNG and step."""

    def __init__(self, trainer):
        self.tr = trainer

    def state(self) -> tuple[dict, dict]:
        tr = self.tr
        extra = {"rng_cpu": torch.get_rng_state(), "scaler": tr.scaler.state_dict()}
        if tr.device.type == "cuda":
            extra["rng_cuda"] = torch.cuda.get_rng_state(tr.device)
        model_sd, optim_sd = tr.parallel.sharded_state(tr.optimizer)  # this rank's pieces, nothing gathered
        tensors = {"model": model_sd, "optim": optim_sd, "extra": extra}
        state = {
            "step": tr.step,
            "loader": tr.batches.state_dict(),
            "config": tr.cfg.to_dict(),
            "world_size": tr.dims.world_size,
            "loom_version": __version__,
        }
        return tensors, state

    def save(self) -> bool:
        """Write a checkpoint (rank 0). A failed write stops the run or only warns (train.on_save_error);
        every rank learns the outcome, so all of them stop or go on together. Returns whether it was saved."""
        tr = self.tr
        tr.op = f"the sharded checkpoint save at step {tr.step}"
        tensors, state = self.state()
        error = None
        try:
            path = checkpoint.save_sharded(
                tr.run_dir / "ckpt", tr.step, tensors["model"], tensors["optim"], tensors["extra"], state,
                tr.cfg.train.keep_last, tr.control, free_bytes=tr.faults.free_bytes,
                after_first_file=lambda tmp: tr.faults.stall_save(tr.step, tmp),
            )  # fmt: skip
            log.info(f"saved checkpoint {path}")
        except LoomError as e:
            error = e if tr.dims.is_main or "another rank" not in e.message else None
        tr.op = f"the checkpoint-result agreement at step {tr.step}"
        failed = tr.control.all_reduce_sum([float(error is not None)])[0] > 0
        if not failed:
            return True
        if tr.cfg.train.on_save_error == "stop":
            raise error or LoomError(f"rank 0 could not write the checkpoint of step {tr.step}; stopping")
        if error is not None:
            log.warn(f"checkpoint of step {tr.step} not saved ({error.message}); training goes on "
                     "(train.on_save_error=continue), the next save tries again")  # fmt: skip
            if tr.metrics:
                tr.metrics.write({"step": tr.step, "ckpt_error": error.message})
        return False

    def load(self, path: Path) -> None:
        tr = self.tr
        sharded = checkpoint.is_sharded(path)
        if sharded:
            tensors, state = checkpoint.load_extra(path)
        else:  # format 1: whole tensors, sliced onto the device per parameter
            tensors, state = checkpoint.load(path, map_location="cpu")
        saved_model = state["config"]["model"]
        defaults = Config().to_dict()["model"]
        diff = [
            f"model.{k}: {saved_model.get(k)!r} -> {v!r}"
            for k, v in tr.cfg.to_dict()["model"].items()
            if saved_model.get(k, defaults[k]) != v  # a key added since the save: the default then
        ]
        if diff:
            raise LoomError(f"checkpoint '{path}' was trained with another model shape: " + "; ".join(diff))
        if sharded:  # each rank reads the pieces its layout holds, whatever layout wrote them
            tr.parallel.load_sharded(tr.optimizer, path / "model", path / "optim")
        else:
            tr.parallel.load_model_state(tensors["model"])
            tr.parallel.load_optim_state(tr.optimizer, tensors["optim"])
        tr.scaler.load_state_dict(tensors["extra"]["scaler"])
        torch.set_rng_state(tensors["extra"]["rng_cpu"])
        if tr.device.type == "cuda" and "rng_cuda" in tensors["extra"]:
            torch.cuda.set_rng_state(tensors["extra"]["rng_cuda"], tr.device)
        tr.batches.load_state_dict(state["loader"])
        tr.step = int(state["step"])
        log.info(
            f"resumed from {path} at step {tr.step} (saved with world size {state.get('world_size', 1)})"
        )
