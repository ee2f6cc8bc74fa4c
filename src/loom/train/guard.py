"""What keeps a long run alive and honest: stop requests from signals, and the bad-step guard.

* `StopRequest`: SIGTERM / SIGINT (preemption, Ctrl-C) only set a flag. The trainer adds the flag to the
  all-reduce it already does at the end of every step, so every rank sees the same sum and all stop after
  the same step; then a checkpoint is saved and the process exits with `EXIT_PREEMPTED`. A second SIGINT
  in a process with no launcher above it aborts at once, except while the run's last checkpoint (the stop
  checkpoint, or the final one) is being written: that one is finished first.
* `StepGuard`: a step whose loss or gradient norm is NaN/Inf, or whose loss is a spike (z-score over a
  window of recent good losses, off by default, as llm.c does), is skipped: no optimizer step. The
  decision uses values that are identical on every rank (the all-reduced loss and the global grad norm).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections import deque

import torch

from loom.errors import LoomError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """A flag set by SIGTERM/SIGINT; `install()` in the main thread, `restore()` when training ends.

    The signal also arms a deadline of `grace_s` (parallel.timeout_s) for the current step to end: a rank
    that cannot get there (stuck waiting for a dead or hung peer) then exits with 128 + the signal number
    instead of holding the job until the launcher's SIGKILL. `disarm()` once every rank has agreed to stop.
    """

    def __init__(self, rank: int = 0, grace_s: float = 600.0):
        self.rank, self.grace_s = rank, grace_s
        self.signal: str | None = None
        self._previous: dict[int, object] = {}
        self._deadline = None

    finishing_what: str | None = None  # set by `finishing`: the last checkpoint, being written

    @contextlib.contextmanager
    def finishing(self, what: str):
        """Within it (the run's last checkpoint being written), SIGINT and SIGTERM no longer interrupt: a second
        Ctrl-C used to abandon the stop checkpoint half written. The user is told it is being finished."""
        self.finishing_what = what
        try:
            yield
        finally:
            self.finishing_what = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def install(self) -> StopRequest:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.disarm()

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.finishing_what is not None:  # the last checkpoint is being written: abandoning it loses it
            if self.rank == 0:
                os.write(
                    2,
                    f"loom: {name} received while {self.finishing_what} is being written: finishing it "
                    "first (it takes seconds; kill -9 abandons it)\n".encode(),
                )
            self.signal = self.signal or name
            return
        # Under a launcher (torchrun, loom --nproc) the agent forwards one signal; by hand, a second Ctrl-C
        # means "now".
        if self.signal is not None and signum == signal.SIGINT and "TORCHELASTIC_RUN_ID" not in os.environ:
            raise KeyboardInterrupt
        if self.signal is None:
            if self.rank == 0:  # os.write: safe inside a signal handler (no locks, unlike the console)
                os.write(
                    2, f"loom: {name} received: stopping after this step and saving a checkpoint\n".encode()
                )
            import threading

            self._deadline = threading.Timer(self.grace_s, self._give_up, args=(signum,))
            self._deadline.daemon = True
            self._deadline.start()
        self.signal = self.signal or name

    def _give_up(self, signum: int) -> None:
        os.write(
            2,
            f"loom: rank {self.rank}: the step did not end within {self.grace_s:g}s of "
            f"{signal.Signals(signum).name}; exiting without a checkpoint\n".encode(),
        )
        os._exit(128 + signum)


# With train.spike_zscore off (0) a loss this many std devs above the recent mean is still recorded (rows, largest
# gradients, lr), not skipped: a spike leaves its trace without the guard changing the run.
NOTE_ZSCORE = 6.0


class StepGuard:
    """Decides whether a step's update is applied; counts skipped steps; says when to give up."""

    def __init__(self, max_bad_steps: int, spike_zscore: float = 0.0, spike_window: int = 100):
        self.max_bad_steps = max_bad_steps
        self.spike_zscore = spike_zscore
        self.recent: deque[float] = deque(maxlen=spike_window)
        self.in_row = 0
        self.skipped = 0
        self.bad_steps: list[int] = []  # steps of the current run of bad steps
        self.note: str | None = None  # the last step's spike, recorded but not skipped (NOTE_ZSCORE)

    def check(self, step: int, loss: float, grad_norm: float, scaler_enabled: bool = False) -> str | None:
        """The reason to skip this step's update, or None to apply it (then `note` says whether it was a spike
        to record all the same).

        With fp16 loss scaling a non-finite gradient norm (an overflow) with a finite loss is the scaler's
        business: it skips the step and lowers the scale; that is not counted as a bad step.
        """
        reason, self.note = None, None
        if not math.isfinite(loss):
            reason = f"non-finite loss ({loss})"
        elif not math.isfinite(grad_norm) and not scaler_enabled:
            reason = f"non-finite gradient norm ({grad_norm})"
        elif (spike := self._spike(loss)) is not None:
            if self.spike_zscore > 0:
                reason = spike
            else:
                self.note = spike
        if reason is None:
            if math.isfinite(loss):
                self.recent.append(loss)
            self.in_row = 0
            self.bad_steps = []
            return None
        self.in_row += 1
        self.skipped += 1
        self.bad_steps.append(step)
        return reason

    def _spike(self, loss: float) -> str | None:
        """The loss as a spike over the full window of recent good losses (train.spike_zscore std devs above
        their mean, NOTE_ZSCORE when that is off), else None. ~100 floats summed: microseconds a step."""
        if len(self.recent) < self.recent.maxlen or len(self.recent) < 2:
            return None
        mean = sum(self.recent) / len(self.recent)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.recent) / (len(self.recent) - 1))
        z = (loss - mean) / std if std > 0 else 0.0
        if z <= (self.spike_zscore or NOTE_ZSCORE):
            return None
        return f"loss spike ({loss:.4f} is {z:.1f} std above the mean {mean:.4f})"

    @property
    def exhausted(self) -> bool:
        return self.in_row >= self.max_bad_steps

    def describe(self, step: int, reason: str, names: list[str]) -> str:
        """The warning for a skipped step."""
        more = f" and {len(names) - 6} more" if len(names) > 6 else ""
        where = f"; non-finite gradients in {', '.join(names[:6])}{more}" if names else ""
        return (
            f"step {step}: update skipped, {reason}{where} ({self.in_row} in a row, {self.skipped} skipped "
            f"in all; limit train.max_bad_steps={self.max_bad_steps})"
        )

    def stop_error(self, step: int, reason: str, names: list[str], saved: bool) -> NonFiniteError:
        """The diagnostic once max_bad_steps bad steps came in a row; `saved`: the checkpoint was written."""
        first, last = self.bad_steps[0], self.bad_steps[-1]
        return NonFiniteError(
            f"{self.in_row} bad steps in a row (steps {first}-{last}; last: {reason})"
            + (f"; non-finite gradients in: {', '.join(names)}" if names else "")
            + (
                f". The last good state (the weights after step {first - 1}) is saved as checkpoint step {step}"
                if saved
                else ". The last good state could not be saved"
            ),
            hint="lower optim.lr or raise optim.warmup_steps (or look at the data of those steps), then continue "
            "with --resume; train.max_bad_steps sets how many bad steps in a row are tolerated",
        )


def grad_flags(model: torch.nn.Module) -> tuple[list[str], torch.Tensor | None, torch.Tensor | None]:
    """(names, 1.0 where this rank's gradient holds a NaN/Inf, each gradient's norm), taken before clipping:
    clipping by a non-finite norm spreads NaN to every gradient. No host sync; read only after a bad step.

    Each gradient's norm is non-finite exactly when it holds a NaN/Inf (or, harmlessly, when its finite
    values overflow the fp32 norm, a step the guard skips anyway): one read of the gradient, where
    `isfinite(g).any()` made six passes and temporaries (~200 ms a step on a 10M-parameter model on a CPU)."""
    names, norms = [], []
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor shard (FSDP, TP)
            names.append(n)
            norms.append(torch.linalg.vector_norm(g, dtype=torch.float32))
    if not norms:
        return names, None, None
    stacked = torch.stack(norms)
    return names, (~torch.isfinite(stacked)).float(), stacked


def nonfinite_names(names: list[str], flags: torch.Tensor | None, all_reduce_sum) -> list[str]:
    """The parameters flagged on any rank (all_reduce_sum: across ranks holding the same list)."""
    if flags is None:
        return []
    total = all_reduce_sum(flags)
    return [n for n, bad in zip(names, total.tolist(), strict=True) if bad > 0]


class NonFiniteError(LoomError):
    """train.max_bad_steps bad steps in a row: the run stopped after saving its last good state."""


def largest_grads(names: list[str], norms: list[float], k: int = 5) -> list[list]:
    """The k parameters with the largest gradient norms, [name, norm] (non-finite ones first: the cause)."""
    order = sorted(range(len(names)), key=lambda i: (math.isfinite(norms[i]), -abs(norms[i])))
    return [[names[i], norms[i]] for i in order[:k]]


def rows_of_step(state: dict, batch_size: int, data_dir, align: str = "none") -> dict:
    """Where the batch a loader's state (before the step) leads to came from: its global rows [first, last] in
    the endless epoch sequence of windows (loom.data.loader.ShardLoader) and the `loom data inspect --rows`
    command that prints them; {} for another loader's state (data.mix and SFT explain their own rows:
    their `explain_rows`)."""
    if set(state) - {"cursor", "seed", "block_size", "windows", "order", "step"}:  # step: a schedule's
        return {}
    first, last = int(state["cursor"]), int(state["cursor"]) + batch_size - 1
    cmd = (
        f"loom data inspect {data_dir} --rows {first}-{last} --block-size {state['block_size']} "
        f"--seed {state['seed']}" + (" --align bos" if align == "bos" else "")
    )
    return {"rows": [first, last], "inspect": cmd}
