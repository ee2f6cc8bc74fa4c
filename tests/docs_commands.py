"""The commands README.md and docs/*.md show, read out of their fenced shell blocks, and the rule that says which
of them a test runs (tests/unit/test_docs_commands.py, tests/integration/test_docs_commands_run.py).

A block is a fence opened with ```bash, ```sh, ```shell or ```console. Its lines are joined at a trailing
backslash, split into words as the shell would (quotes kept together, `# ...` comments dropped), and cut into
commands at `;` and `&&`. A word `...` stands for "your options" and is dropped: what remains must still be a
whole command.

The rule for each command, in this order (the first that matches):
- `make TARGET ...`: TARGET must be a rule of the Makefile. Not run (make builds a virtualenv).
- `python ... benchmarks/X.py`: the script must exist. Not run (benchmarks take minutes, some need a GPU).
- a `loom` command, also after a launcher (`srun ... loom`, `torchrun ... -m loom`, `mpiexec -n 4 loom`) or
  inside `loom launch -- loom ...`: it must parse (the verb exists, its options are accepted and every
  `--section.key=value` is a config key with a value it takes). It is also RUN, and must exit 0, when it is
  quick here: a help text (`--help`, `-h`, `--help-config`), `loom plan` without `--check` (an estimate),
  `loom doctor` without `--nodes` (its probes start processes: run by the integration test). Every other
  loom command trains, reads a run or data the page tells the reader to make or download, starts processes,
  or needs a GPU or a cluster: `why_not_run` names which.
- anything else (`source`, `pip`, `kill`, `tar`, ...) is the reader's shell, not loom's: listed, not checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

TOP = Path(__file__).resolve().parents[1]
SHELL_FENCES = ("bash", "sh", "shell", "console")
LAUNCHERS = ("srun", "pbsdsh", "mpiexec", "mpirun", "torchrun", "timeout")


@dataclass(frozen=True)
class Command:
    page: str  # e.g. docs/data.md
    line: int  # the line the command starts on
    words: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{' '.join(self.words)[:60]}"


def pages() -> list[Path]:
    return [TOP / "README.md", *sorted((TOP / "docs").glob("*.md"))]


def shell_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every fenced shell block, continuation lines joined."""
    out, fence, pending, start = [], None, "", 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence not in SHELL_FENCES:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def commands(path: Path) -> list[Command]:
    page = str(path.relative_to(TOP))
    found = []
    for n, line in shell_lines(path.read_text(encoding="utf-8")):
        words: list[str] = []
        for w in shlex.split(line, comments=True) + [";"]:
            if w in (";", "&&") or w.endswith(";"):
                if w.endswith(";") and w != ";":
                    words.append(w[:-1])
                if words:
                    found.append(Command(page, n, tuple(words)))
                words = []
            elif w != "...":
                words.append(w)
    return found


def all_commands() -> list[Command]:
    return [c for p in pages() for c in commands(p)]


def loom_argv(words: tuple[str, ...]) -> list[str] | None:
    """The arguments after `loom` (or `-m loom`), past environment assignments and launchers; None if none."""
    for i, w in enumerate(words):
        if w == "loom" or (w == "-m" and i + 1 < len(words) and words[i + 1] == "loom"):
            return list(words[i + 1 + (w == "-m") :])
        if not (re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w) or i > 0 or w in LAUNCHERS):
            return None
    return None


def launched(words: tuple[str, ...]) -> bool:
    return words[0] in LAUNCHERS or any(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w) for w in words[:1])


def inner_command(argv: list[str]) -> list[str] | None:
    """`loom launch [opts] -- loom train ...`: the arguments of the loom command it launches."""
    if argv[:1] == ["launch"] and "--" in argv:
        rest = tuple(argv[argv.index("--") + 1 :])
        return loom_argv(rest)
    return None


def is_help(argv: list[str]) -> bool:
    return not argv or any(a in ("-h", "--help", "--help-config") for a in argv)


def runs_here(cmd: Command) -> bool:
    """Quick here, in this process: help texts and `loom plan` estimates (the doctor: see `runs_as_process`)."""
    argv = loom_argv(cmd.words)
    if argv is None or launched(cmd.words):
        return False
    return is_help(argv) or (argv[0] == "plan" and "--check" not in argv)


def runs_as_process(cmd: Command) -> bool:
    """`loom doctor` (not `--nodes`, which needs hosts): quick, but its probes start processes."""
    argv = loom_argv(cmd.words)
    return argv is not None and not launched(cmd.words) and argv[:1] == ["doctor"] and "--nodes" not in argv


def why_not_run(cmd: Command) -> str:
    """The rule's reason for checking a loom command's parse only."""
    argv = loom_argv(cmd.words) or []
    text = " ".join(cmd.words)
    if launched(cmd.words) or argv[:1] == ["launch"] or "--nodes" in argv:
        return "a launcher or cluster"
    if "cuda" in text or "fp8" in text or "triton" in text:
        return "a GPU"
    if "--nproc" in argv or "--world" in argv:
        return "starts processes, or a dry run of many ranks: minutes"
    if argv[:1] in (["train"], ["sft"], ["rl"], ["verify"], ["bench"]):
        return "trains or measures: minutes"
    if argv[:1] == ["data"]:
        return "reads input the reader brings or downloads"
    if "--check" in argv:
        return "dry-runs the planner's layouts: minutes"
    return "reads a run or folder the page makes first"
