"""What the tests that run the pages' commands share (tests/integration/test_docs_commands_run*.py): each
command as a pytest param (its id says `scaled` when THE SCALE RULE changed it), the page's folder made once
per session (reader_inputs, then PAGE_SETUP), and the run of one command with its exit code checked. The rule,
the table of commands not run and the scale rule are in tests/docs_commands.py."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from docs_commands import (
    PAGE_SETUP,
    TOP,
    Command,
    commands,
    complete,
    loom_argv,
    page_runs,
    reader_inputs,
    resumes,
    run_in,
    scale,
)

# The pages of each test file (pytest-xdist --dist loadfile gives each file a worker): every page in one.
PAGE_GROUPS = {
    "test_docs_commands_run.py": ["README.md", "docs/data.md", "docs/training.md", "docs/evaluation.md"],
    "test_docs_commands_run_parallel.py": [
        "docs/parallelism.md",
        "docs/long-context.md",
        "docs/moe.md",
        "docs/slow-links.md",
        "docs/operations.md",
    ],
    "test_docs_commands_run_post.py": [
        "docs/post-training.md",
        "docs/serving.md",
        "docs/models.md",
        "docs/gpu-kit.md",
        "docs/ARCHITECTURE.md",
    ],
}


@dataclass(frozen=True)
class PageCommand:
    cmd: Command
    argv: list[str] | None  # the loom arguments run (None: a `python scripts/...` line)
    scaled: bool


def page_commands(page: str) -> list[PageCommand]:
    every = commands(TOP / page)
    out, resumed = [], 0
    for c in page_runs(page):
        if loom_argv(c.words) is None:
            out.append(PageCommand(c, None, False))
            continue
        whole = complete(c, every)
        resumed += resumes(whole)
        argv = scale(whole, resumed)
        out.append(PageCommand(c, argv, argv != loom_argv(c.words)))
    return out


def page_params(pages: list[str]) -> list:
    return [
        pytest.param(pc, id=f"{pc.cmd.id}{' [scaled]' if pc.scaled else ''}")
        for page in pages
        for pc in page_commands(page)
    ]


_FOLDERS: dict[str, Path | Exception] = {}


def page_folder(cmd: PageCommand, tmp_path_factory, monkeypatch, capfd) -> Path:
    """The page's working folder, made at its first command: the reader's inputs, then PAGE_SETUP (the
    session's LOOM_CACHE_DIR, tests/conftest.py's: the built-in corpus is prepared once)."""
    page = cmd.cmd.page
    if page not in _FOLDERS:
        folder = tmp_path_factory.mktemp(page.replace("/", "_").replace(".md", ""))
        try:
            reader_inputs(folder)
            for line in PAGE_SETUP.get(page, []):
                words = tuple(shlex.split(line))
                code, out = run_in(folder, words, list(words[1:]), monkeypatch)
                if code:
                    shown = capfd.readouterr()
                    raise AssertionError(
                        f"setup of {page}: `{line}` exited {code}\n{out}{shown.out[-3000:]}\n{shown.err[-3000:]}"
                    )
            _FOLDERS[page] = folder
        except Exception as e:  # every command of the page then reports it
            _FOLDERS[page] = e
    if isinstance(_FOLDERS[page], Exception):
        raise _FOLDERS[page]
    return _FOLDERS[page]


def run_page_command(pc: PageCommand, tmp_path_factory, monkeypatch, capfd) -> None:
    """Run the command in its page's folder (made at the page's first command) and check it exits 0."""
    folder = page_folder(pc, tmp_path_factory, monkeypatch, capfd)
    code, out = run_in(folder, pc.cmd.words, pc.argv, monkeypatch)
    captured = capfd.readouterr()
    shown = " ".join(pc.cmd.words) if pc.argv is None else "loom " + " ".join(pc.argv)
    assert code == 0, (
        f"{pc.cmd.page}:{pc.cmd.line}: `{shown}` exited {code}\n{out}\n{captured.out[-3000:]}\n{captured.err[-3000:]}"
    )
