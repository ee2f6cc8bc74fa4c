"""Reward functions: a sample (its prompt row and the model's answer) -> a float.

Built-ins: `exact` (the answer's final line equals the row's answer field, stripped), `numeric` (the answer's
last number equals the field's, within 1e-6), `regex` (1 when rl.pattern matches the answer, else 0). A
function of your own is named `module:function` and loaded like a family plug-in (imported by name); it takes a
`Sample` and returns a number. A reward that raises, or returns NaN or something not a number, or runs longer
than rl.reward_timeout seconds, is a counted skip (`score` returns None and the reason), never a crash mid-run.
Rewards compose as a weighted sum (`0.2*regex+exact`: R1-Zero's format reward plus its correctness reward).

While rewards are scored (`RewardGuard`), a SIGTERM or SIGINT reaches the trainer's stop handler as always and
also interrupts the reward running then: a reward that hangs cannot hold a stop (the rollout is abandoned and
the step not taken: loom.rl.stage).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loom import log
from loom.errors import LoomError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # loom.train.guard.StopRequest's


class RewardTimeout(BaseException):
    """Raised inside a reward function that ran past rl.reward_timeout. A BaseException, like KeyboardInterrupt:
    a reward's own `except Exception` must not swallow it."""


class RewardStopped(BaseException):
    """Raised inside a reward function when a stop signal arrives while it runs (the run is stopping)."""


class RewardGuard:
    """Each reward call bounded by `timeout` seconds (0: unbounded) with SIGALRM, and stop signals noted
    (`stopped`) and made to interrupt the call under way. Signals reach only the main thread: elsewhere the
    calls run unbounded (said once)."""

    def __init__(self, timeout: float = 0.0):
        self.timeout = timeout
        self.stopped: str | None = None  # the stop signal seen while scoring, if any
        self._armed = False  # inside a reward call: a signal now interrupts it
        self._main = False
        self._warned = False

    @contextlib.contextmanager
    def watching(self) -> Iterator[RewardGuard]:
        """Install the handlers for a scoring pass (main thread only), chained to the ones they replace."""
        self._main = threading.current_thread() is threading.main_thread()
        if not self._main:
            if self.timeout > 0 and not self._warned:
                self._warned = True
                log.warn("rl.reward_timeout needs the main thread (SIGALRM): rewards run unbounded here")
            yield self
            return
        previous = {s: signal.getsignal(s) for s in (*STOP_SIGNALS, signal.SIGALRM)}

        def on_stop(signum, frame):
            self.stopped = self.stopped or signal.Signals(signum).name
            before = previous[signum]
            if callable(before):  # the trainer's StopRequest: its flag, its deadline
                before(signum, frame)
            if self._armed:
                self._armed = False
                raise RewardStopped

        def on_alarm(signum, frame):
            if self._armed:
                self._armed = False
                raise RewardTimeout

        try:
            for s in STOP_SIGNALS:
                signal.signal(s, on_stop)
            signal.signal(signal.SIGALRM, on_alarm)
            yield self
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, handler in previous.items():
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def call(self, fn: Callable, arg):
        """fn(arg), interrupted by RewardTimeout past the timeout or RewardStopped on a stop signal."""
        if not self._main:
            return fn(arg)
        self._armed = True
        if self.timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            return fn(arg)
        finally:
            self._armed = False  # first: a signal handled from here on returns without raising
            if self.timeout > 0:
                signal.setitimer(signal.ITIMER_REAL, 0)


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

    def score(
        self, row: dict, text: str, guard: RewardGuard | None = None
    ) -> tuple[float | None, str | None]:
        """(reward, None), or (None, why) when the function raised, returned NaN or a non-number, or ran past
        the guard's timeout. RewardStopped (a stop signal during the call) propagates."""
        sample = Sample(row, text, row.get(self.field) if self.field else None)
        start = time.monotonic()
        try:
            value = guard.call(self.fn, sample) if guard is not None else self.fn(sample)
        except RewardTimeout:
            took = time.monotonic() - start
            return None, f"{self.name} ran {took:.1f}s, past rl.reward_timeout={guard.timeout:g}s"
        except Exception as e:  # a user's function: any failure is its sample's counted skip
            return None, f"{self.name} raised {type(e).__name__}: {e}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None, f"{self.name} returned {type(value).__name__} {value!r}, not a number"
        if not math.isfinite(float(value)):
            return None, f"{self.name} returned {value}"
        return float(value), None

    def correct(self, row: dict, text: str, guard: RewardGuard | None = None) -> bool:
        """Whether the answer counts as correct on the held-out set: a reward > 0 (a failed one is not)."""
        v, _ = self.score(row, text, guard)
        return v is not None and v > 0


@dataclass(frozen=True)
class SumReward:
    """A weighted sum of rewards (R1-Zero's format reward plus its correctness reward: `0.2*regex+exact`).
    A term that fails fails the sum (its sample is a counted skip); an answer is correct on the held-out set
    when every term is > 0 (right, and in the asked format)."""

    name: str
    terms: tuple[tuple[float, Reward], ...]

    @property
    def field(self) -> str | None:
        return next((r.field for _, r in self.terms if r.field), None)

    def _values(self, row: dict, text: str, guard) -> tuple[list[float] | None, str | None]:
        out = []
        for _, r in self.terms:
            v, why = r.score(row, text, guard)
            if v is None:
                return None, why
            out.append(v)
        return out, None

    def score(self, row: dict, text: str, guard: RewardGuard | None = None):
        values, why = self._values(row, text, guard)
        if values is None:
            return None, why
        return float(sum(w * v for (w, _), v in zip(self.terms, values, strict=True))), None

    def correct(self, row: dict, text: str, guard: RewardGuard | None = None) -> bool:
        values, _ = self._values(row, text, guard)
        return values is not None and all(v > 0 for v in values)


def load_reward(name: str, field: str, pattern: str = "") -> Reward | SumReward:
    """The reward rl.reward names: a built-in, `module:function` imported now (a module that does not import,
    or a name it lacks, is a LoomError before any work), or a weighted sum of them, `0.2*regex+exact`."""
    if "+" in name or "*" in name:
        return _sum(name, field, pattern)
    return _one(name, field, pattern)


def _sum(name: str, field: str, pattern: str) -> SumReward:
    terms = []
    for term in name.split("+"):
        w, _, part = term.strip().rpartition("*")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            weight = math.nan
        if not part or not math.isfinite(weight):
            raise LoomError(
                f"rl.reward='{name}': the term '{term}' is not [WEIGHT*]REWARD",
                hint="e.g. rl.reward=0.2*regex+exact (a format reward, rl.pattern, plus a correctness reward)",
            )
        terms.append((weight, _one(part.strip(), field, pattern)))
    return SumReward(name, tuple(terms))


def _one(name: str, field: str, pattern: str) -> Reward:
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
