"""The one error type for user mistakes: a message and a hint that says what to do (layer 0)."""

from __future__ import annotations


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
