"""Environments for multi-turn RL episodes (rl.env=module:Class): the class loaded and checked before any work,
and each call of an environment run so that a fault drops its episode instead of the run.

An environment is a class of yours, made once per episode with no arguments:
    reset(row) -> str                  the first observation (may be ""): what the model reads after the prompt
    step(text) -> (observation | None, reward, done)
                                       the model's turn as text; the observation the model reads next (None:
                                       nothing), a float reward (an episode's reward is the sum of its steps'),
                                       and whether the episode has ended
    stop: tuple[str, ...]              (optional) the texts that end a model's turn in the text format, e.g.
                                       ("</calc>",): the model writes <calc>12*34</calc> and the turn ends there
    tool_errors: int                   (optional) the tool calls it could not run (a malformed call answered
                                       with an error observation): summed into rl/tool_errors

A call that raises, returns something else than the above, or runs longer than rl.env_timeout_s drops its
episode (and so its group: an advantage needs every answer's reward), counted in rl/env_dropped; so does an
episode that never ends (rl.max_turns turns, or no room left in its token budget).

Each call runs in a thread of its own that the caller waits for at most rl.env_timeout_s: a Python
environment that hangs (a loop, a sleep, a socket) is abandoned there and its episode dropped; the thread
itself cannot be killed (Python has no way to), so it runs on in the background as a daemon and ends with
the process. A hang inside C code that holds the GIL cannot be cut this way: it stops the whole process.
"""

from __future__ import annotations

import importlib
import math
import numbers
import threading
from typing import Any

from loom.errors import LoomError


class EnvFault(Exception):
    """An environment call that failed (raised, timed out, returned a wrong type): its episode is dropped."""


def load_env(spec: str) -> type:
    """The class rl.env names (`module:Class`), imported now: a module that does not import, a name it lacks,
    or a class without reset and step is a LoomError before any work. A built-in's short name (loom.rl.envs's
    BUILT_IN: `calculator`) is taken too."""
    from loom.rl.envs import BUILT_IN

    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise LoomError(
            f"rl.env='{spec}' is not module:Class",
            hint="e.g. rl.env=loom.rl.envs:Calculator (a class with reset(row) and step(text)), or a built-in: "
            "calculator",
        )
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or the module's own failure at import
        raise LoomError(
            f"rl.env='{spec}': module '{module}' does not import ({type(e).__name__}: {e})",
            hint="put the module on PYTHONPATH (or in the working directory) and check that it imports",
        ) from None
    cls = getattr(mod, name, None)
    if not isinstance(cls, type):
        raise LoomError(
            f"rl.env='{spec}': module '{module}' has no class '{name}'",
            hint="name a class with reset(row) -> str and step(text) -> (observation, reward, done)",
        )
    lacking = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if lacking:
        raise LoomError(
            f"rl.env='{spec}': the class has no {' or '.join(lacking)} method",
            hint="an environment has reset(row) -> str and step(text) -> (observation or None, reward, done)",
        )
    stop = getattr(cls, "stop", ())
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise LoomError(
            f"rl.env='{spec}': its 'stop' is {stop!r}, not a tuple of non-empty texts",
            hint='e.g. stop = ("</calc>",): the texts that end a model\'s turn (a tool call)',
        )
    return cls


def call(fn, args: tuple, timeout: float) -> Any:
    """fn(*args) in a daemon thread waited for at most `timeout` seconds (0: unbounded); EnvFault when it
    raises or runs past the timeout (the thread is abandoned: the module's docstring)."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (whatever the environment raises drops its episode)
            out["error"] = e

    t = threading.Thread(target=target, name="loom-rl-env", daemon=True)
    t.start()
    t.join(timeout if timeout > 0 else None)
    if t.is_alive():
        raise EnvFault(f"{_name(fn)} ran past rl.env_timeout_s={timeout:g}s")
    if "error" in out:
        e = out["error"]
        raise EnvFault(f"{_name(fn)} raised {type(e).__name__}: {e}")
    return out.get("value")


def _name(fn) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", "the environment"))


def new_env(cls: type, timeout: float):
    """An environment for one episode (its constructor guarded as its calls are)."""
    return call(cls, (), timeout)


def reset(env, row: dict, timeout: float) -> str:
    """env.reset(row): the first observation, a string."""
    obs = call(env.reset, (row,), timeout)
    if not isinstance(obs, str):
        raise EnvFault(f"reset returned {type(obs).__name__}, not a string")
    return obs


def step(env, text: str, timeout: float) -> tuple[str | None, float, bool]:
    """env.step(text) checked: (a string or None, a finite number, a bool)."""
    out = call(env.step, (text,), timeout)
    if not isinstance(out, tuple) or len(out) != 3:
        raise EnvFault(f"step returned {type(out).__name__}, not (observation, reward, done)")
    obs, reward, done = out
    if obs is not None and not isinstance(obs, str):
        raise EnvFault(f"step returned an observation of type {type(obs).__name__}, not a string or None")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise EnvFault(f"step returned the reward {reward!r}, not a finite number")
    if not isinstance(done, (bool, numbers.Integral)):
        raise EnvFault(f"step returned done={done!r}, not a bool")
    return obs, float(reward), bool(done)


def tool_errors(env) -> int:
    """The tool calls the environment could not run, as it counts them (0 when it does not)."""
    n = getattr(env, "tool_errors", 0)
    return int(n) if isinstance(n, numbers.Integral) else 0
