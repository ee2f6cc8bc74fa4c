"""Three small char-level sources for the data.mix tests (a module beside conftest.py, on the tests' path):
each holds every character of the others (one alphabet document), so all three share one tokenizer, and
each its own text (its own seeds), so its rows can be told apart."""

from __future__ import annotations

import random
import string
from pathlib import Path

ALPHABET = string.ascii_letters + ". \n"
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def make_text(n_chars: int, seed: int) -> str:
    """Words of random lowercase letters in sentences (a bare `conftest` import may resolve to another
    folder's conftest.py, so not its make_text)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(300)]
    out, size = [], 0
    while size < n_chars:
        sent = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
        out.append(sent + ("\n" if rng.random() < 0.3 else " "))
        size += len(out[-1])
    return "".join(out)[:n_chars]


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
