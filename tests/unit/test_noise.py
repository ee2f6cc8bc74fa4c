"""Third-party noise filtered at the command's start (loom.log.quiet_third_party, issue 58), shown with
LOOM_DEBUG=1 or `loom --verbose`. Compared in fresh interpreters (filters are process-wide): the same known
warnings, through torchao's logger and torch's FutureWarning path, hidden without the variable and shown with it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# torchao's logger as its import uses it, and torch's deprecation as DTensor's redistribute triggers it (the
# module a warning is attributed to is the caller's, as stacklevel=2 gives it)
PROBE = """
import logging, warnings
from loom.cli import main
main(["--verbose", "--version"] if VERBOSE else ["--version"])
logging.getLogger("torchao").warning("Failed to load _C_mxfp8.cpython-310-x86_64-linux-gnu.so")
warnings.warn_explicit(
    "`torch.distributed._functional_collectives.all_gather_tensor` is deprecated.",
    FutureWarning, "redistribute.py", 1, module="torch.distributed.tensor._redistribute",
)
warnings.warn("loom's own warning stays", UserWarning)
"""


def _probe(debug: str | None, verbose: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LOOM_DEBUG"}
    if debug is not None:
        env["LOOM_DEBUG"] = debug
    code = f"VERBOSE = {verbose}\n{PROBE}"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stderr


@pytest.mark.parametrize(
    "debug,verbose,shown", [(None, False, False), ("1", False, True), (None, True, True)]
)
def test_known_warnings_hidden_unless_debug(debug, verbose, shown):
    err = _probe(debug, verbose)
    assert ("Failed to load _C_mxfp8" in err) is shown, err
    assert ("all_gather_tensor` is deprecated" in err) is shown, err
    assert "loom's own warning stays" in err  # not third-party: never filtered
