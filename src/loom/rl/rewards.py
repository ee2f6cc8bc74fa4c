"""Reward functions: a sample (its prompt row and the model's answer) -> a float.

Built-ins: `exact` (the answer's final line equals the row's answer field, stripped), `numeric` (the answer's
last number equals the field's, within 1e-6), `regex` (1 when rl.pattern matches the answer, else 0). A
function of your own is named `module:function` and loaded like a family plug-in (imported by name); it takes a
`Sample` and returns a number. A reward that raises, or returns NaN or something not a number, is a counted skip
(`score` returns None and the reason), never a crash mid-run.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass

from loom.errors import LoomError

BUILTIN = ("exact", "numeric", "regex")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Sample:
    """What a reward function sees: the prompt's JSONL row (every field), the answer's text, and the row's
    answer field (None when the reward needs none)."""

    row: dict
    text: str
    answer: object = None


def final_answer(text: str) -> str:
    """The answer's last non-empty line, after a '####' when it has one (GSM8K's mark), stripped."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def exact(sample: Sample) -> float:
    return float(final_answer(sample.text) == str(sample.answer).strip())


def numeric(sample: Sample) -> float:
    found = _NUMBER.findall(sample.text)
    if not found:
        return 0.0
    try:
        want = float(sample.answer)
    except (TypeError, ValueError):
        raise ValueError(f"the answer field {sample.answer!r} is not a number") from None
    return float(abs(float(found[-1]) - want) <= 1e-6)


@dataclass(frozen=True)
class Reward:
    """A reward function by name, and the prompt field it needs (None: none)."""

    name: str
    fn: Callable[[Sample], object]
    field: str | None

    def score(self, row: dict, text: str) -> tuple[float | None, str | None]:
        """(reward, None), or (None, why) when the function raised or returned NaN or a non-number."""
        sample = Sample(row, text, row.get(self.field) if self.field else None)
        try:
            value = self.fn(sample)
        except Exception as e:  # a user's function: any failure is its sample's counted skip
            return None, f"{self.name} raised {type(e).__name__}: {e}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None, f"{self.name} returned {type(value).__name__} {value!r}, not a number"
        if not math.isfinite(float(value)):
            return None, f"{self.name} returned {value}"
        return float(value), None


def load_reward(name: str, field: str, pattern: str = "") -> Reward:
    """The reward rl.reward names: a built-in, or `module:function` imported now (a module that does not import,
    or a name it lacks, is a LoomError before any work)."""
    if name == "exact":
        return Reward(name, exact, field)
    if name == "numeric":
        return Reward(name, numeric, field)
    if name == "regex":
        return Reward(name, _regex(pattern), None)
    if ":" not in name:
        raise LoomError(
            f"rl.reward='{name}' is neither a built-in ({', '.join(BUILTIN)}) nor module:function",
            hint="e.g. rl.reward=numeric, or rl.reward=my_rewards:score (a module on PYTHONPATH)",
        )
    module, _, fn_name = name.partition(":")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or the module's own failure at import
        raise LoomError(
            f"rl.reward='{name}': module '{module}' does not import ({type(e).__name__}: {e})",
            hint="put the module on PYTHONPATH (or in the working directory) and check that it imports",
        ) from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise LoomError(
            f"rl.reward='{name}': module '{module}' has no function '{fn_name}'",
            hint="name a function that takes a loom.rl.rewards.Sample and returns a float",
        )
    return Reward(name, fn, None)


def _regex(pattern: str) -> Callable[[Sample], float]:
    if not pattern:
        raise LoomError("rl.reward=regex needs rl.pattern", hint="e.g. --rl.pattern='^\\d+$'")
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise LoomError(f"rl.pattern '{pattern}' is not a regular expression: {e}") from None
    return lambda s: float(rx.search(s.text.strip()) is not None)
