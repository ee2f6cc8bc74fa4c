"""Three small char-level sources for the data.mix tests (a module beside conftest.py, on the tests' path):
each holds every character of the others (one alphabet document), so all three share one tokenizer, and
each its own text (its own seeds), so its rows can be told apart."""

from __future__ import annotations

import string
from pathlib import Path

from conftest import make_text

ALPHABET = string.ascii_letters + ". \n"
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def make_sources(root: Path, chars: int = 6000) -> dict[str, Path]:
    """Prepared folders web, code and math under root (char tokenizer, a quarter of the documents for val)."""
    from loom.data.prepare import prepare

    out = {}
    for k, name in enumerate(WEIGHTS):
        docs = root / f"{name}-docs"
        docs.mkdir(parents=True)
        (docs / "alphabet.txt").write_text(ALPHABET * 4)
        for i in range(4):
            (docs / f"doc{i}.txt").write_text(make_text(chars, seed=100 * k + i))
        out[name] = root / name
        prepare([docs], out[name], tokenizer="char", val_fraction=0.25, seed=0)
    return out


def mix_flags(sources: dict[str, Path], weights: dict[str, float] = WEIGHTS) -> list[str]:
    """--data.sources and --data.mix for `loom train`."""
    named = ",".join(f"{n}={p}" for n, p in sources.items())
    return [f"--data.sources={named}", "--data.mix=" + ",".join(f"{n}:{w}" for n, w in weights.items())]
