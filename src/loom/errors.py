"""The one error type for user mistakes: a message and a hint that says what to do (layer 0)."""

from __future__ import annotations

EXIT_ERROR = 2  # a LoomError: the message says what to change
# Stopped by SIGTERM/SIGINT after saving a checkpoint at the end of the current step. 75 is sysexits'
# EX_TEMPFAIL ("try again later"): run the same command with --resume (or train.resume=auto) to continue.
EXIT_PREEMPTED = 75


class LoomError(Exception):
    """A user-facing error. The CLI prints it without a traceback and exits with code 2.

    `hint` is the remedy: what the user should type or change (llm.c's HINT: lines).
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class PeerError(LoomError):
    """Rank 0 found a user error and has reported it; the other ranks stop quietly."""
