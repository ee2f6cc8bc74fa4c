"""Built-in corpora: real text on every machine, offline.

A built-in corpus is clean by construction, so that preparing it warns about nothing (the first screen of
`make demo`): no empty files, no file that repeats another byte for byte (a copy in val of a file that trains
makes the val loss too low). The warnings stay for users' data.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from loom.errors import LoomError

EXCLUDED_DIRS = {"test", "tests", "site-packages", "__pycache__"}
# Part of the cache key of a prepared built-in corpus (train/setup.py): raised whenever the files chosen
# change, so that a cache prepared by an older loom is prepared again. 2: empty files and repeats left out.
CORPUS_VERSION = 2


def cache_name(name: str) -> str:
    """The folder name of a prepared built-in corpus in the cache (before the tokenizer's part)."""
    return f"{name}-v{CORPUS_VERSION}"


def python_stdlib_files() -> list[Path]:
    """The running interpreter's standard-library .py files (no test folders, no site-packages), sorted,
    without empty files (three empty __init__.py in 3.11) and without files that repeat an earlier one's bytes
    (the first, in sorted order, is kept)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    out, seen = [], set()
    for p in sorted(files):
        data = p.read_bytes()
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if data.strip() and digest not in seen:
            seen.add(digest)
            out.append(p)
    return out


CORPORA = {"python-stdlib": python_stdlib_files}


def corpus_files(name: str) -> list[Path]:
    if name not in CORPORA:
        raise LoomError(f"unknown built-in corpus '{name}'", hint=f"known: {', '.join(CORPORA)}")
    files = CORPORA[name]()
    if not files:
        raise LoomError(f"built-in corpus '{name}' found no files on this machine")
    return files
