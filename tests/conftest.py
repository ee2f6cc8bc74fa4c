"""Shared fixtures: tiny corpora and prepared data made by the tests themselves (never ../shared)."""

from __future__ import annotations

import os
import random

import pytest
import tiers

# One CPU thread per process, for this process (set before torch is imported) and every process a test starts
# (they inherit it). `make test` runs two pytest workers on two cores, so a process with torch's default of one
# thread per core shares its cores with the other worker and spins in OpenMP waiting for them: a 3-step
# single-process `loom train` of the verify model took 16.6 s of wall and 16 s of CPU that way on this
# 2-core machine with a second job running, 4.9 s and 4.4 s with one thread. Multi-process launches already
# give each process cores / nproc threads (loom.train.spawn).
os.environ.setdefault("OMP_NUM_THREADS", "1")

WORDS = (
    "the of and to in is that it for as with was on be by at this from have or an they which one you were "
    "her all she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like"
).split()


def make_text(n_chars: int, seed: int = 0) -> str:
    """Deterministic pseudo-English with sentences and line breaks."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        sent = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
        sent += "\n" if rng.random() < 0.3 else " "
        out.append(sent)
        size += len(sent)
    return "".join(out)[:n_chars]


@pytest.fixture
def text_maker():
    """make_text for tests outside this folder's import path (a bare `conftest` may resolve to another one)."""
    return make_text


def pytest_collection_modifyitems(config, items):
    """Mark the tests that start processes (tests/tiers.py): `make test-fast` runs the others."""
    tiers.mark(items)


def pytest_sessionfinish(session, exitstatus):
    """Stop multiprocessing's fork server if a test started it (tests/gloo_ranks.py, loom train --nproc in this process), waiting for it: it ends
    with this process anyway, and waited for, its CPU time (its ranks') counts in this process's children's."""
    from loom.train.spawn import stop_server

    stop_server()


@pytest.fixture(autouse=True)
def _in_process_only(request, monkeypatch):
    """Under `make test-fast`, a test that starts a process anyway is skipped there (make test runs it)."""
    if tiers.fast_only(request.config):
        tiers.guard(monkeypatch)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep every test's cache (CPU peak, built-in corpora) out of the user's home."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "loom-cache"))


@pytest.fixture(scope="session")
def char_data(tmp_path_factory):
    """A prepared char-level directory: 40k characters in 8 documents."""
    from loom.data.prepare import prepare

    root = tmp_path_factory.mktemp("chardata")
    docs = root / "docs"
    docs.mkdir()
    for i in range(8):
        (docs / f"doc{i}.txt").write_text(make_text(5000, seed=i))
    out = root / "prepared"
    prepare([docs], out, tokenizer="char", val_fraction=0.25, seed=0)
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A tiny base run (char tokenizer) and chat data prepared with its tokenizer (tests/sftkit.py)."""
    from sftkit import make_sft_root

    return make_sft_root(tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="session")
def tool_run(tmp_path_factory):
    """A tiny chat run `loom sft` taught to call tools, and its base run (tests/toolkit.py; ~1 min, shared by
    test_serve_tools.py and test_serve_structured.py)."""
    from toolkit import make_tool_root

    return make_tool_root(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def rl_root(tmp_path_factory):
    """The arithmetic task, a tiny base run on its sums, chat data and a short SFT run (tests/rlkit.py)."""
    from rlkit import make_rl_root

    return make_rl_root(tmp_path_factory.mktemp("rl"))
