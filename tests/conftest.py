"""Shared fixtures: tiny corpora and prepared data made by the tests themselves (never ../shared)."""

from __future__ import annotations

import random

import pytest

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
