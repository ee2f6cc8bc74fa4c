"""Test hooks that inject failures into real runs (layer 0). Never set in normal use.

tests/faults/ starts real `loom train` processes and needs them to fail at a chosen point: a NaN in a
gradient, a checkpoint write that stalls half way (so the test can SIGKILL it there), a disk that looks
full, a rank that hangs. The hooks are read once, from LOOM_FAULT_* environment variables, into a frozen
value that the trainer and checkpoint code receive explicitly; with none set, every hook is off.

  LOOM_FAULT_NAN_STEPS   steps whose gradients get a NaN: "5", "5,9", "5-7" or "5-" (5 and after)
  LOOM_FAULT_NAN_RANK    only this rank injects (default: every rank)
  LOOM_FAULT_NAN_PARAM   the parameter whose gradient is poisoned (default: the model's first)
  LOOM_FAULT_STALL_SAVE  step whose checkpoint write stalls after its first file (marker file STALLED)
  LOOM_FAULT_DISK_FULL   step whose checkpoint write fails with ENOSPC after its first file (a disk that fills)
  LOOM_FAULT_HOLD_SAVE   1: every checkpoint write pauses after its first file until the test deletes the marker
                         file HELD it leaves in the temporary folder (a save still being written, for as long
                         as the test needs)
  LOOM_FAULT_FREE_BYTES  free disk space the checkpoint writer believes it has
  LOOM_FAULT_HANG_STEP   step at which LOOM_FAULT_HANG_RANK (default 1) stops, before its collectives
  LOOM_FAULT_SLOW_RANK   this rank sleeps LOOM_FAULT_SLOW_MS (default 100) in LOOM_FAULT_SLOW_PHASE (default
                         forward; or data, backward, optimizer) of every step: a straggler
  LOOM_FAULT_OOM_STEP    step whose forward raises torch.OutOfMemoryError (a simulated allocation failure)
  LOOM_FAULT_CORRUPT_STEP  step whose targets are replaced by random tokens (a corrupted batch: a loss spike)
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from loom.errors import LoomError


def _steps(text: str) -> tuple[tuple[int, int], ...]:
    """'5,9-11,20-' -> ((5, 5), (9, 11), (20, max)) inclusive ranges."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            out.append((int(lo), int(hi) if hi else (2**62 if dash else int(lo))))
        except ValueError:
            raise LoomError(
                f"LOOM_FAULT_NAN_STEPS: cannot read '{part}'", hint="write 5, 5-7 or 5-"
            ) from None
    return tuple(out)


def _int(env, name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise LoomError(f"{name} must be an integer, got '{value}'") from None


@dataclass(frozen=True)
class Faults:
    nan_steps: tuple[tuple[int, int], ...] = ()
    nan_rank: int | None = None
    nan_param: str = ""
    stall_save_step: int | None = None
    free_bytes: int | None = None
    disk_full_step: int | None = None
    hold_save: bool = False
    hang_step: int | None = None
    hang_rank: int = 1
    slow_rank: int | None = None
    slow_ms: int = 100
    slow_phase: str = "forward"
    oom_step: int | None = None
    corrupt_step: int | None = None

    def nan_at(self, step: int, rank: int) -> bool:
        """Whether this rank poisons a gradient at `step` (1-based: the step being computed)."""
        return (self.nan_rank is None or self.nan_rank == rank) and any(
            a <= step <= b for a, b in self.nan_steps
        )

    def poison_grad(self, model) -> None:
        """A NaN in one parameter's gradient (LOOM_FAULT_NAN_PARAM, else the first), after synchronisation."""
        import torch

        named = {n: p for n, p in model.named_parameters() if p.grad is not None}
        name = self.nan_param or next(iter(named))
        if name not in named:
            raise LoomError(f"LOOM_FAULT_NAN_PARAM: no parameter '{name}' with a gradient")
        with torch.no_grad():
            named[name].grad.fill_(float("nan"))

    def mid_save(self, step: int, tmp_dir: Path) -> None:
        """Called by the checkpoint writer after its first file: at the chosen steps, fail as a disk that has
        just filled up, or stall forever; with hold_save, wait (every save) until the test lets it go on."""
        if self.disk_full_step == step:
            raise OSError(errno.ENOSPC, "No space left on device (LOOM_FAULT_DISK_FULL)")
        if self.hold_save:
            held = tmp_dir / "HELD"
            held.write_text(str(os.getpid()))
            while held.exists():
                time.sleep(0.01)
        if self.stall_save_step == step:
            (tmp_dir / "STALLED").write_text(str(os.getpid()))
            while True:
                time.sleep(1)

    def hang(self, step: int, rank: int) -> None:
        """A rank that stops making progress before the collectives of `step` (a stuck data read)."""
        if self.hang_step == step and self.hang_rank == rank:
            while True:
                time.sleep(1)

    def slow(self, phase: str, rank: int) -> None:
        """A straggler: LOOM_FAULT_SLOW_RANK sleeps in its chosen phase of every step."""
        if self.slow_rank == rank and self.slow_phase == phase:
            time.sleep(self.slow_ms / 1000)

    def oom(self, step: int) -> None:
        """A simulated allocation failure, as the CUDA caching allocator raises it."""
        if self.oom_step == step:
            import torch

            raise torch.OutOfMemoryError(
                f"LOOM_FAULT_OOM_STEP={step}: simulated out of memory (tried to allocate 2.00 GiB)"
            )

    def corrupt(self, step: int, y, vocab: int):
        """A corrupted batch at LOOM_FAULT_CORRUPT_STEP: targets drawn uniformly from the vocabulary (a model that
        learned anything has a loss above log(vocab) on them: a spike); elsewhere the targets as they came."""
        if self.corrupt_step != step:
            return y
        import torch

        g = torch.Generator().manual_seed(step)
        return torch.randint(0, vocab, y.shape, generator=g).to(y.device, y.dtype)


def from_env(env=None) -> Faults:
    env = os.environ if env is None else env
    return Faults(
        nan_steps=_steps(env.get("LOOM_FAULT_NAN_STEPS", "")),
        nan_rank=_int(env, "LOOM_FAULT_NAN_RANK"),
        nan_param=env.get("LOOM_FAULT_NAN_PARAM", ""),
        stall_save_step=_int(env, "LOOM_FAULT_STALL_SAVE"),
        free_bytes=_int(env, "LOOM_FAULT_FREE_BYTES"),
        disk_full_step=_int(env, "LOOM_FAULT_DISK_FULL"),
        hold_save=bool(_int(env, "LOOM_FAULT_HOLD_SAVE")),
        hang_step=_int(env, "LOOM_FAULT_HANG_STEP"),
        hang_rank=1 if (rank := _int(env, "LOOM_FAULT_HANG_RANK")) is None else rank,
        slow_rank=_int(env, "LOOM_FAULT_SLOW_RANK"),
        slow_ms=100 if (ms := _int(env, "LOOM_FAULT_SLOW_MS")) is None else ms,
        slow_phase=env.get("LOOM_FAULT_SLOW_PHASE", "").strip() or "forward",
        oom_step=_int(env, "LOOM_FAULT_OOM_STEP"),
        corrupt_step=_int(env, "LOOM_FAULT_CORRUPT_STEP"),
    )
