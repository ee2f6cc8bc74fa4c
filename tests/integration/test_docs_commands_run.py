"""`loom doctor` as README.md and docs/*.md show it (the rule in tests/docs_commands.py) runs and exits 0:
its probes (MPI, torch.compile) start processes of their own, so it runs here, as the reader would run it,
in a process of its own. Compared against: exit 0 and the report's last line."""

import os

import pytest
from docs_commands import TOP, all_commands, loom_argv, runs_as_process
from loomrun import loom_run

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
