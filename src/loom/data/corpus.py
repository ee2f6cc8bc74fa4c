"""Built-in corpora: real text on every machine, offline."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from loom.errors import LoomError

EXCLUDED_DIRS = {"test", "tests", "site-packages", "__pycache__"}


def python_stdlib_files() -> list[Path]:
    """The running interpreter's standard-library .py files (no test folders, no site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    return sorted(files)


CORPORA = {"python-stdlib": python_stdlib_files}


def corpus_files(name: str) -> list[Path]:
    if name not in CORPORA:
        raise LoomError(f"unknown built-in corpus '{name}'", hint=f"known: {', '.join(CORPORA)}")
    files = CORPORA[name]()
    if not files:
        raise LoomError(f"built-in corpus '{name}' found no files on this machine")
    return files
