"""The two tiers of the suite: a test that starts a process (a subprocess, gloo or elastic ranks, mpiexec, a
process group) is marked `processes` at collection; `make test-fast` runs the others.

The mark comes from what a test uses, read from its source, so it is never a list to keep up: the test
function, the fixtures it requests and every function or class of the tests' own modules they name (followed
to the end) are searched for the calls that start a process (STARTERS) and for the `loom` verbs that do
(`--nproc`, verify, doctor, launch). A test that reaches a process through loom's own code (a data
preparation with two workers, the dry run's forked ranks), which this search does not follow, is found when it
runs: under `-m "not processes"` the fork or exec is refused and the test skipped there (guard()), so the fast
tier is exactly the tests that run in its process, and `make test` still runs every test.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import subprocess
import sys
import textwrap

import pytest

MARK = "processes"

# names whose use starts a process: the standard library's, torch's launchers, and the tests' own helpers
# whose source starts one through something this search cannot follow (a src function)
STARTERS = {
    "subprocess",
    "Popen",
    "check_output",
    "fork",
    "forkserver",
    "spawn",
    "spawn_gloo",
    "start_processes",
    "elastic_launch",
    "launch_local",
    "start_loom",
    "killpg",
    "setsid",
    "start_new_session",
    "mpiexec",
    "run_mpi",
    "ProcessPoolExecutor",
    "verify_main",
    "mpi_info",
    "compile_check",
}
# command-line words that make `loom` (in this process too: loomrun.loom_here) start processes
VERBS = {"--nproc", "verify", "doctor", "launch"}
# the tests' helper modules: names a test imports from them are followed into them
HELPERS = ("loomrun", "sftkit", "evalkit", "gloo_ranks", "proctree", "faultkit")


def _names(node: ast.AST) -> set[str]:
    """Every identifier, attribute and short string constant in a syntax tree."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value) < 40:
            out.add(n.value)
            out.add(n.value.split("=")[0])  # f"--nproc={n}" holds the constant "--nproc="
        elif isinstance(n, ast.alias):
            out.add(n.asname or n.name.split(".")[-1])
    return out


@functools.cache
def _module_defs(path: str) -> dict[str, frozenset[str]]:
    """name -> the names its source uses, for each top-level function, class and assignment of a file."""
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError):
        return {}
    defs: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = frozenset(_names(node))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    defs[target.id] = frozenset(_names(node.value))
    return defs


def _helper_paths() -> list[str]:
    paths = []
    for name in HELPERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            paths.append(module.__file__)
    return paths


def _starts(names: set[str], paths: tuple[str, ...], seen: set[tuple[str, str]]) -> bool:
    """Whether these names start a process, directly or through a definition in one of the files."""
    if names & (STARTERS | VERBS):
        return True
    for path in paths:
        defs = _module_defs(path)
        for name in names & defs.keys():
            if (path, name) in seen:
                continue
            seen.add((path, name))
            if _starts(set(defs[name]), paths, seen):
                return True
    return False


def _source_names(obj) -> set[str]:
    try:
        return _names(ast.parse(textwrap.dedent(inspect.getsource(obj))))
    except (OSError, TypeError, SyntaxError):
        return set()


def starts_processes(item: pytest.Item) -> bool:
    """Whether a collected test, its fixtures or what they call start a process."""
    objs = [item.obj]
    infos = getattr(item, "_fixtureinfo", None)
    for defs in infos.name2fixturedefs.values() if infos else ():
        objs += [d.func for d in defs]
    helpers = tuple(_helper_paths())
    return any(_function_starts(obj, helpers) for obj in objs)


@functools.cache
def _function_starts(obj, helpers: tuple[str, ...]) -> bool:
    """Whether one function (a test or a fixture: many tests ask about each fixture) starts a process."""
    module = inspect.getmodule(obj)
    own = (module.__file__,) if module is not None and getattr(module, "__file__", None) else ()
    return _starts(_source_names(obj), tuple(dict.fromkeys(own + helpers)), set())


def mark(items: list[pytest.Item]) -> None:
    """Mark every test that starts a process (pytest_collection_modifyitems)."""
    for item in items:
        if item.get_closest_marker(MARK) is None and starts_processes(item):
            item.add_marker(MARK)


def fast_only(config: pytest.Config) -> bool:
    """Whether this run deselects the tests that start processes (make test-fast)."""
    expr = config.getoption("markexpr", "") or ""
    return f"not {MARK}" in expr


def guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a process skips the test (one the search above missed): fork and exec are where every
    subprocess, multiprocessing and torch launcher start ends. pytest's Skipped is not an Exception, so the
    code under test does not catch it as a failed start."""
    import _posixsubprocess

    def refuse(*args, **kwargs):
        pytest.skip("starts a process through loom's code (make test runs it; tests/tiers.py)")

    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(os, "posix_spawnp", refuse)
    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)
    if hasattr(subprocess, "_fork_exec"):  # subprocess binds its own name for it (Python 3.11 on)
        monkeypatch.setattr(subprocess, "_fork_exec", refuse)
