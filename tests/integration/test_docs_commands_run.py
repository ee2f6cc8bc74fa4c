"""The commands README.md and docs/*.md show RUN as the pages print them and exit 0 (the rule and THE SCALE RULE
in tests/docs_commands.py): each page's commands in the page's order, in a folder of its own holding what the
page tells the reader to bring, the long ones scaled down to a few steps; the commands that need a GPU, a
cluster, downloads or minutes are listed with their reason in docs_commands.NOT_RUN. `loom doctor` runs as a
process of its own (its probes start processes). Compared against: exit 0 (and the doctor's report).

The pages are split over tests/integration/test_docs_commands_run*.py (pytest-xdist gives each file a worker)."""

import os

import pytest
from docs_commands import TOP, all_commands, loom_argv, runs_as_process
from docs_run_pages import PAGE_GROUPS, page_params, run_page_command
from loomrun import loom_run

# a page's commands run in order and later ones read what earlier ones made; some start processes (python
# scripts/..., --nproc 2), which make test-fast refuses: the whole page belongs to make test
pytestmark = pytest.mark.processes

PAGES = PAGE_GROUPS["test_docs_commands_run.py"]

# a command shown on several pages (README's and operations.md's `loom doctor`) runs once, named by its first
DOCTOR = list({c.words: c for c in reversed([c for c in all_commands() if runs_as_process(c)])}.values())[
    ::-1
]


def test_the_pages_show_the_doctor():
    assert DOCTOR, "README.md shows `loom doctor`; the extraction found none"


@pytest.mark.parametrize("cmd", DOCTOR, ids=lambda c: c.id)
def test_doctor_as_shown_runs_and_exits_0(cmd, tmp_path):
    env = {**os.environ, "LOOM_CACHE_DIR": str(tmp_path)}
    r = loom_run(*loom_argv(cmd.words), cwd=TOP, env=env, timeout=300)
    assert r.returncode == 0, f"{cmd.id} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert r.stdout.strip()


@pytest.mark.parametrize("cmd", page_params(PAGES))
def test_page_command_runs(cmd, tmp_path_factory, monkeypatch, capfd):
    run_page_command(cmd, tmp_path_factory, monkeypatch, capfd)
