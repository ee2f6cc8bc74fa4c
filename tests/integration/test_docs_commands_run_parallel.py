"""The commands of the pages on parallelism, long context, mixtures of experts, slow links and operations run as printed and exit 0 (scaled down by THE SCALE
RULE; NOT_RUN lists the others with their reason): tests/docs_commands.py has the rule,
tests/integration/test_docs_commands_run.py the other pages. Compared against: exit 0."""

import pytest
from docs_run_pages import PAGE_GROUPS, page_params, run_page_command

# a page's commands run in order and later ones read what earlier ones made; some start processes (python
# scripts/..., --nproc 2), which make test-fast refuses: the whole page belongs to make test
pytestmark = pytest.mark.processes


@pytest.mark.parametrize("cmd", page_params(PAGE_GROUPS["test_docs_commands_run_parallel.py"]))
def test_page_command_runs(cmd, tmp_path_factory, monkeypatch, capfd):
    run_page_command(cmd, tmp_path_factory, monkeypatch, capfd)
