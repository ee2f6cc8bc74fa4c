"""The one error type for user mistakes: a message and a hint that says what to do (layer 0)."""

from __future__ import annotations

EXIT_ERROR = 2  # a LoomError: the message says what to change
# Stopped by SIGTERM/SIGINT after saving a checkpoint at the end of the current step. 75 is sysexits'
# EX_TEMPFAIL ("try again later"): run the same command with --resume (or train.resume=auto) to continue.
EXIT_PREEMPTED = 75
# The device ran out of memory; with train.memory_snapshot the snapshot was written first (the message names
# it). 71 is sysexits' EX_OSERR: a system resource ran out, not a mistake in the command.
EXIT_OUT_OF_MEMORY = 71


class LoomError(Exception):
    """A user-facing error. The CLI prints it without a traceback and exits with code 2.

    `hint` is the remedy: what the user should type or change (llm.c's HINT: lines). `code`: the exit code.
    """

    code = EXIT_ERROR

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class PeerError(LoomError):
    """Rank 0 found a user error and has reported it; the other ranks stop quietly."""


class OutOfMemoryStop(LoomError):
    """The device ran out of memory during a step (train.memory_snapshot: after the snapshot was written)."""

    code = EXIT_OUT_OF_MEMORY


class StopBeforeStep(Exception):
    """Raised by a training stage, on every rank alike, when a stop signal arrived while it prepared the step's
    batch and it gave the batch up (loom rl: a reward that hangs cannot hold a stop): the step is not taken, and
    the run stops and saves as after a step (loom.train.trainer)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why
