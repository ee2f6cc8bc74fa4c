"""The trainer's checkpoint component: what a checkpoint holds, saving it (every rank learns the outcome),
and loading it back into any layout."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from loom import __version__, checkpoint, log
from loom.config import check_model_config
from loom.distributed.comm import Control
from loom.errors import LoomError, PeerError


class Checkpointer:
    """Saves and loads the trainer's model, optimizer, loader, scaler, RNG and step."""

    def __init__(self, trainer):
        self.tr = trainer
        self._inflight = None  # (step, result box, thread) of a background save
        self._stager = self._group = self._control = None

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

    # ------------------------------------------------------------------------------- saving
    def async_enabled(self) -> bool:
        mode = self.tr.cfg.train.async_ckpt
        return self.tr.device.type == "cuda" if mode == "auto" else mode == "true"

    def _write(self, step: int, tensors: dict, state: dict, control, group=None) -> LoomError | None:
        """Every rank's part of a sharded save; the error it ended with (every rank raises when one fails)."""
        tr = self.tr
        try:
            path = checkpoint.save_sharded(
                tr.run_dir / "ckpt", step, tensors["model"], tensors["optim"], tensors["extra"], state,
                tr.cfg.train.keep_last, control, free_bytes=tr.faults.free_bytes,
                after_first_file=lambda tmp: tr.faults.mid_save(step, tmp), group=group,
            )  # fmt: skip
            log.info(f"saved checkpoint {path}")
        except LoomError as e:
            return e if tr.dims.is_main or "another rank" not in e.message else None
        return None

    last_error: LoomError | None = None  # of the newest failed save (save_last names it)
    # True within save_last: the run's last save, whose failure is not train.on_save_error's to decide
    _last = False

    def save(self, background: bool = False) -> bool:
        """Write a checkpoint: each rank its own shards. A failed write stops the run or only warns
        (train.on_save_error); every rank learns the outcome, so all of them stop or go on together. Returns
        whether it was saved. `background` (with train.async_ckpt): copy the shards to host memory and write
        them in a thread; its outcome is agreed on when the next save (or the end of the run) waits for it."""
        import time

        tr = self.tr
        t0 = time.perf_counter()
        busy = self._inflight is not None and self._inflight[2].is_alive()
        self.wait()  # at most one save in flight
        waited = time.perf_counter() - t0
        if busy and tr.main:
            log.warn(f"the background save of the previous checkpoint was still writing: the loop waited "
                     f"{waited:.2f}s for it before step {tr.step}'s save; saves come faster than they are "
                     "written, so raise train.ckpt_every (or write to faster storage)")  # fmt: skip
        tr.op = f"the sharded checkpoint save at step {tr.step}"
        tensors, state = self.state()
        if background and self.async_enabled():
            self._start(tensors, state)
            self._record(waited, time.perf_counter() - t0)
            return True
        saved = self._saved_everywhere(tr.step, self._write(tr.step, tensors, state, tr.control), self._last)
        self._record(waited, time.perf_counter() - t0)
        return saved

    def _record(self, waited: float, blocked: float) -> None:
        """metrics.jsonl gets, per save, how long the loop stood still for it (`ckpt_blocked_s`) and the part
        of that spent waiting for the previous background save to finish (`ckpt_waited_s`)."""
        if self.tr.metrics:
            self.tr.metrics.write({"step": self.tr.step, "ckpt_blocked_s": round(blocked, 4),
                                   "ckpt_waited_s": round(waited, 4)})  # fmt: skip

    def _saved_everywhere(self, step: int, error: LoomError | None, last: bool = False) -> bool:
        """Every rank learns whether the save of `step` failed anywhere. A failure raises under
        train.on_save_error=stop, else warns and returns False; `last`: the run's last save (save_last
        decides what follows, whatever the policy)."""
        tr = self.tr
        tr.op = f"the checkpoint-result agreement at step {step}"
        failed = tr.control.all_reduce_sum([float(error is not None)])[0] > 0
        if not failed:
            return True
        self.last_error = error or LoomError(f"another rank could not write the checkpoint of step {step}")
        if tr.cfg.train.on_save_error == "stop" and not last:
            raise self.last_error
        if error is not None:
            then = ("it is the run's last save" if last else
                    "training goes on (train.on_save_error=continue), the next save tries again")  # fmt: skip
            log.warn(f"checkpoint of step {step} not saved ({error.message}); {then}")
            if tr.metrics:
                tr.metrics.write({"step": step, "ckpt_error": error.message})
        return False

    def save_last(self, what: str) -> None:
        """The run's last save (`what`: "final" at its end, "stop" on a signal). No later save makes up for
        it, so a failure is retried once, and a second one ends the run with an error that says which steps
        are in no checkpoint and what to do (under either train.on_save_error)."""
        tr = self.tr
        self.last_error, self._last = None, True
        try:
            for attempt in (1, 2):
                if attempt == 2:
                    log.warn(f"retrying the {what} checkpoint of step {tr.step} once")
                if self.save():
                    return
        finally:
            self._last = False
        ckpt_dir = tr.run_dir / "ckpt"
        newest = checkpoint.latest_valid(ckpt_dir, share=None)  # sizes only: the message, not a resume
        since = checkpoint.read_state(newest)["step"] if newest is not None else 0
        reason = self.last_error.message if self.last_error else "unknown error"
        then = (f"--resume continues from step {since} ('{newest}') and redoes steps {since + 1}-{tr.step}"
                if newest is not None else "the run has no checkpoint: start it again with --force")  # fmt: skip
        msg = (f"the {what} checkpoint of step {tr.step} could not be saved (tried twice: {reason}); "
               f"steps {since + 1}-{tr.step} of this run are in no checkpoint")  # fmt: skip
        hint = (
            f"free disk space or fix the permissions of '{ckpt_dir}' (or set run.dir elsewhere), then {then}"
        )
        if tr.metrics:
            tr.metrics.write({"step": tr.step, "stopped": f"{what} checkpoint not saved"})
        if tr.dims.is_main:
            raise LoomError(msg, hint=hint)
        raise PeerError(msg, hint=hint)  # rank 0 prints the message

    def warm(self) -> None:
        """For background saves, once, after the first step (when the optimizer state exists; called on every
        rank: the writer's process group is made here): make the host staging buffers (pinned and kept on a
        GPU), the writer's group and DCP's modules now, so that the first save's step costs what every later one
        does instead of ~0.3 s more on 59M parameters (benchmarks/async_ckpt.py)."""
        if self._stager is not None or not self.async_enabled():
            return
        import torch.distributed.checkpoint  # noqa: F401  (its planner and writer: imported here, not in the thread)

        from loom.parallel.dcp_state import HostStager

        self._stager = HostStager(self.tr.device.type == "cuda")
        self._group, self._control = _background_group()
        tensors, _ = self.state()
        for part in ("model", "optim"):
            self._stager.stage(part, tensors[part])

    def _start(self, tensors: dict, state: dict) -> None:
        """Stage this rank's shards to host memory (the only part the loop waits for), then write them in a
        thread whose collectives run on a gloo group of their own, never beside the training's."""
        import threading

        tr = self.tr
        self.warm()
        staged = {part: self._stager.stage(part, tensors[part]) for part in ("model", "optim")}
        staged["extra"] = tensors["extra"]
        step, control, group = tr.step, self._control or Control(), self._group
        # without a process group (one process, MPI) rank 0 writes alone: the thread needs no collective
        writes = self._group is not None or tr.dims.is_main
        box: dict = {}

        def run() -> None:
            _yield_cores()
            box["error"] = self._write(step, staged, state, control, group) if writes else None

        self._inflight = (step, box, threading.Thread(target=run, name=f"loom-ckpt-{step}", daemon=True))
        self._inflight[2].start()

    def wait(self) -> bool | None:
        """Wait for the save in flight, if any, and agree on its outcome; None when there was none."""
        if self._inflight is None:
            return None
        step, box, thread = self._inflight
        self._inflight = None
        self.tr.op = f"the background checkpoint save of step {step}"
        thread.join()
        return self._saved_everywhere(
            step, box.get("error", LoomError(f"the checkpoint writer of step {step} crashed"))
        )

    def load(self, path: Path) -> None:
        tr = self.tr
        sharded = checkpoint.is_sharded(path)
        if sharded:
            tensors, state = checkpoint.load_extra(path)
        else:  # format 1: whole tensors, sliced onto the device per parameter
            tensors, state = checkpoint.load(path, map_location="cpu")
        check_model_config(state["config"]["model"], tr.cfg, f"checkpoint '{path}'",
                           "resume with the checkpoint's model settings, or start a new run")  # fmt: skip
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


def _yield_cores() -> None:
    """A low scheduling priority (nice 10) for the calling thread and the threads it starts (on Linux nice
    is per thread; elsewhere this does nothing): where training keeps every core busy (CPU training) the
    writer then takes ~10% of the CPU instead of a core. Measured on 2 cores (benchmarks/async_ckpt.py, 59M):
    nice 0 slowed every step ~1.7x while a save was in flight; nice 19 left the loop alone but starved the
    writer, so the next save waited for it (blocked 0.78x of a synchronous save); nice 10 blocks 0.22x with
    steps ~14% slower while the writer runs. With the compute on GPUs the cores are idle and it matters little."""
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def _background_group():
    """(process group, control plane) for a background save: a gloo group of every rank, so that DCP's and
    the manifest's collectives in the writer thread never interleave with the training's; (None, None)
    without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    from loom.distributed.comm import TorchControl

    group = dist.new_group(backend="gloo")
    return group, TorchControl(group)
