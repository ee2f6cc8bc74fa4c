"""The trainer's checkpoint component: what a checkpoint holds, saving it (every rank learns the outcome),
and loading it back into any layout. It is handed the Stateful parts it saves (loom.train.state) and the few
values and hooks it needs of the job, never the trainer: a new resumable part is one more Stateful."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from loom import __version__, checkpoint, log
from loom.config import Config, check_saved_config
from loom.distributed.comm import Control
from loom.errors import LoomError, PeerError
from loom.faults import Faults
from loom.train.state import Stateful, TrainState


@dataclass(frozen=True)
class CheckpointParts:
    """The resumable state of a run, laid out on disk as every loom version reads it: model/ and optim/ (DCP
    shards; format 1: model.pt and optim.pt), extra.pt with the RNG's keys and "scaler", state.json with the
    train state's keys ("step") and "loader" beside the run's config, world size and loom version."""

    model_optim: Stateful  # {"model", "optim"}: loom.train.state.ModelOptimState
    loader: Stateful
    scaler: Stateful
    rng: Stateful  # {"rng_cpu", "rng_cuda" on a GPU}
    train: TrainState  # the step the checkpoint is of


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where checkpoints go, how often, and what a save does when it fails or may run in the background."""

    folder: Path  # the run's ckpt/
    keep_last: int  # train.keep_last
    on_save_error: str = "stop"  # train.on_save_error: "stop" | "continue"
    async_ckpt: str = "auto"  # train.async_ckpt: "auto" (on a GPU) | "true" | "false"
    every: int = 0  # train.ckpt_every: a save every that many steps (0: only the final one)

    @classmethod
    def of(cls, cfg: Config, run_dir: Path) -> CheckpointPolicy:
        t = cfg.train
        return cls(run_dir / "ckpt", t.keep_last, t.on_save_error, t.async_ckpt, t.ckpt_every)


@dataclass(frozen=True)
class CheckpointJob:
    """What the checkpointer needs of the job around it: values, the control plane and hooks."""

    config: Config  # saved in state.json; a resumed checkpoint's model must match its model section
    world_size: int
    is_main: bool
    device_type: str  # "cuda": background saves by default, staged in pinned memory
    control: Control  # every rank learns each save's outcome through it
    faults: Faults  # test hooks: a disk that fills up, a crash in the middle of a save
    # a metrics record (metrics.jsonl is opened after the checkpointer is made, so a callable, not the sinks)
    record: Callable[[dict], None]
    # names the operation under way: the error a failed or timed-out collective raises says which
    name_op: Callable[[str], None]
    # what the run records of itself in every state.json: run_id, base (loom.runs.origin)
    origin: dict = field(default_factory=dict)
    # the run's last save is written within it (loom.train.guard.StopRequest.finishing: a second Ctrl-C
    # no longer abandons it half written); its argument says which save
    finishing: Callable[[str], AbstractContextManager] = nullcontext


class Checkpointer:
    """Saves and loads the Stateful parts of a run: model and optimizer, loader, scaler, RNG, train state."""

    def __init__(self, parts: CheckpointParts, policy: CheckpointPolicy, job: CheckpointJob):
        self.parts, self.policy, self.job = parts, policy, job
        self._inflight = None  # (step, result box, thread) of a background save
        self._stager = self._group = self._control = None

    @property
    def step(self) -> int:
        return self.parts.train.step

    def state(self) -> tuple[dict, dict]:
        """This rank's (tensors {"model", "optim", "extra"}, state.json) in the checkpoint format."""
        p, job = self.parts, self.job
        extra = {**p.rng.state_dict(), "scaler": p.scaler.state_dict()}
        tensors = {**p.model_optim.state_dict(), "extra": extra}  # this rank's pieces, nothing gathered
        state = {
            **p.train.state_dict(),
            "loader": p.loader.state_dict(),
            "config": job.config.to_dict(),
            "world_size": job.world_size,
            "loom_version": __version__,
            **job.origin,
        }
        return tensors, state

    # ------------------------------------------------------------------------------- saving
    def async_enabled(self) -> bool:
        mode = self.policy.async_ckpt
        return self.job.device_type == "cuda" if mode == "auto" else mode == "true"

    def _write(self, step: int, tensors: dict, state: dict, control, group=None) -> LoomError | None:
        """Every rank's part of a sharded save; the error it ended with (every rank raises when one fails)."""
        faults = self.job.faults
        try:
            path = checkpoint.save_sharded(
                self.policy.folder,
                step,
                tensors["model"],
                tensors["optim"],
                tensors["extra"],
                state,
                self.policy.keep_last,
                control,
                free_bytes=faults.free_bytes,
                after_first_file=lambda tmp: faults.mid_save(step, tmp),
                group=group,
            )
            log.info(f"saved checkpoint {path}")
        except LoomError as e:
            return e if self.job.is_main or "another rank" not in e.message else None
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

        t0 = time.perf_counter()
        busy = self._inflight is not None and self._inflight[2].is_alive()
        self.wait()  # at most one save in flight
        waited, step = time.perf_counter() - t0, self.step
        if busy and self.job.is_main:
            log.warn(
                f"the background save of the previous checkpoint was still writing: the loop waited "
                f"{waited:.2f}s for it before step {step}'s save; saves come faster than they are "
                "written, so raise train.ckpt_every (or write to faster storage)"
            )
        self.job.name_op(f"the sharded checkpoint save at step {step}")
        tensors, state = self.state()
        if background and self.async_enabled():
            self._start(tensors, state)
            self._record(waited, time.perf_counter() - t0)
            return True
        saved = self._saved_everywhere(step, self._write(step, tensors, state, self.job.control), self._last)
        self._record(waited, time.perf_counter() - t0)
        return saved

    def _record(self, waited: float, blocked: float) -> None:
        """metrics.jsonl gets, per save, how long the loop stood still for it (`ckpt_blocked_s`) and the part
        of that spent waiting for the previous background save to finish (`ckpt_waited_s`)."""
        rec = {"step": self.step, "ckpt_blocked_s": round(blocked, 4), "ckpt_waited_s": round(waited, 4)}
        self.job.record(rec)

    def _saved_everywhere(self, step: int, error: LoomError | None, last: bool = False) -> bool:
        """Every rank learns whether the save of `step` failed anywhere. A failure raises under
        train.on_save_error=stop, else warns and returns False; `last`: the run's last save (save_last
        decides what follows, whatever the policy)."""
        self.job.name_op(f"the checkpoint-result agreement at step {step}")
        failed = self.job.control.all_reduce_sum([float(error is not None)])[0] > 0
        if not failed:
            return True
        self.last_error = error or LoomError(f"another rank could not write the checkpoint of step {step}")
        if self.policy.on_save_error == "stop" and not last:
            raise self.last_error
        if error is not None:
            then = (
                "it is the run's last save"
                if last
                else "training goes on (train.on_save_error=continue), the next save tries again"
            )
            log.warn(f"checkpoint of step {step} not saved ({error.message}); {then}")
            self.job.record({"step": step, "ckpt_error": error.message})
        return False

    def after_step(self, step: int, final: bool) -> None:
        """What is due after a step: at the run's last step the final save (`save_last`); with
        train.ckpt_every, once the warm-up of background saves, then a save every ckpt_every steps (with
        train.async_ckpt written in a thread)."""
        if final:
            self.save_last("final")
            return
        if not self.policy.every:
            return
        self.warm()  # after this process's first step (then at once returns)
        if step % self.policy.every == 0:
            self.save(background=True)

    def save_last(self, what: str) -> None:
        """The run's last save (`what`: "final" at its end, "stop" on a signal). No later save makes up for
        it, so a failure is retried once, and a second one ends the run with an error that says which steps
        are in no checkpoint and what to do (under either train.on_save_error)."""
        self.last_error, self._last, step = None, True, self.step
        try:
            with self.job.finishing(f"the {what} checkpoint of step {step}"):
                for attempt in (1, 2):
                    if attempt == 2:
                        log.warn(f"retrying the {what} checkpoint of step {step} once")
                    if self.save():
                        return
        finally:
            self._last = False
        ckpt_dir = self.policy.folder
        newest = checkpoint.latest_valid(ckpt_dir, share=None)  # sizes only: the message, not a resume
        since = checkpoint.read_state(newest)["step"] if newest is not None else 0
        reason = self.last_error.message if self.last_error else "unknown error"
        then = (
            f"--resume continues from step {since} ('{newest}') and redoes steps {since + 1}-{step}"
            if newest is not None
            else "the run has no checkpoint: start it again with --force"
        )
        msg = (
            f"the {what} checkpoint of step {step} could not be saved (tried twice: {reason}); "
            f"steps {since + 1}-{step} of this run are in no checkpoint"
        )
        hint = (
            f"free disk space or fix the permissions of '{ckpt_dir}' (or set run.dir elsewhere), then {then}"
        )
        self.job.record({"step": step, "stopped": f"{what} checkpoint not saved"})
        if self.job.is_main:
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

        self._stager = HostStager(self.job.device_type == "cuda")
        self._group, self._control = _background_group()
        tensors, _ = self.state()
        for part in ("model", "optim"):
            self._stager.stage(part, tensors[part])

    def _start(self, tensors: dict, state: dict) -> None:
        """Stage this rank's shards to host memory (the only part the loop waits for), then write them in a
        thread whose collectives run on a gloo group of their own, never beside the training's."""
        import threading

        self.warm()
        staged = {part: self._stager.stage(part, tensors[part]) for part in ("model", "optim")}
        staged["extra"] = tensors["extra"]
        step, control, group = self.step, self._control or Control(), self._group
        # without a process group (one process, MPI) rank 0 writes alone: the thread needs no collective
        writes = self._group is not None or self.job.is_main
        box: dict = {}
        args = (box, writes, step, staged, state, control, group)
        writer = threading.Thread(target=self._writer, args=args, name=f"loom-ckpt-{step}", daemon=True)
        self._inflight = (step, box, writer)
        writer.start()

    def _writer(self, box: dict, writes: bool, *save) -> None:
        """The background save's thread: its outcome in `box` for wait(). A peer lost inside the save (a
        communication error, which checkpoint.save_sharded raises at once) is kept to be raised by wait() on
        the training thread, as a synchronous save raises it: no agreement after it (a peer may sit in the
        save's collective, and the two would wait for each other)."""
        _yield_cores()
        try:
            box["error"] = self._write(*save) if writes else None
        except Exception as e:
            box["raised"] = e

    def wait(self) -> bool | None:
        """Wait for the save in flight, if any, and agree on its outcome; None when there was none."""
        if self._inflight is None:
            return None
        step, box, thread = self._inflight
        self._inflight = None
        self.job.name_op(f"the background checkpoint save of step {step}")
        thread.join()
        if "raised" in box:
            raise box["raised"]
        return self._saved_everywhere(
            step, box.get("error", LoomError(f"the checkpoint writer of step {step} crashed"))
        )

    def load(self, path: Path) -> None:
        """Resume every part from a checkpoint folder of either format, saved under any layout."""
        p = self.parts
        if checkpoint.is_sharded(path):  # each rank reads the pieces its layout holds from the DCP folders
            tensors, state = checkpoint.load_extra(path)
            tensors.update(model=path / "model", optim=path / "optim")
        else:  # format 1: whole tensors, sliced onto the device per parameter
            tensors, state = checkpoint.load(path, map_location="cpu")
        check_saved_config(
            state["config"],
            self.job.config,
            f"checkpoint '{path}'",
            "resume with the checkpoint's model settings, or start a new run",
        )
        p.model_optim.load_state_dict({"model": tensors["model"], "optim": tensors["optim"]})
        extra = tensors["extra"]
        p.scaler.load_state_dict(extra["scaler"])
        p.rng.load_state_dict({k: v for k, v in extra.items() if k != "scaler"})
        p.loader.load_state_dict(state["loader"])
        p.train.load_state_dict(state)  # state.json's top level: "step"
        log.info(
            f"resumed from {path} at step {self.step} (saved with world size {state.get('world_size', 1)})"
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
