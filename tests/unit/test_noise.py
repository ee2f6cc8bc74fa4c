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


def test_the_in_training_sample_does_not_recompile_compiled_blocks(tmp_path):
    """train.compile compiles each block in place; the sample's prompt and growing lengths recompiled them up to
    torch.compile's recompile limit (its warning block at a compiled run's sample). The sample runs eager."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from loom.data.tokenizers import CharTokenizer
    from loom.generate import Sampler
    from loom.model.gpt.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=70, n_layer=2, n_head=2, n_embd=32, block_size=32))
    compiled: list[int] = []

    def counting(gm, example_inputs):  # a backend that counts the graphs dynamo hands it, and runs them eager
        compiled.append(len(example_inputs))
        return gm.forward

    blocks = [m for m in model.modules() if type(m).__name__ == "Block"]
    assert blocks
    for block in blocks:
        block.compile(backend=counting)
    model(torch.zeros(2, 8, dtype=torch.long))  # a training-shaped forward compiles the blocks' code
    trained = len(compiled)
    assert trained >= 1
    tok = CharTokenizer.train(["abcdefgh ijk"])
    ctx = SimpleNamespace(
        parallel=SimpleNamespace(sampling_model=lambda: model),
        tokenizer=tok,
        device=torch.device("cpu"),
        step=5,
        autocast=contextlib.nullcontext,
    )
    found = Sampler(5, 12, 0, False, tmp_path / "samples.txt").run(ctx)
    assert found is not None and len(compiled) == trained  # the sample compiled nothing more


# the profiler's start and stop as loom.train.profile makes them, and a line of native code's own beside them
PROFILER_PROBE = """
import os, torch
from loom import log
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
with log.without_native_lines("USDT:"):
    prof.start()
    os.write(2, b"a native error line stays\\n")
torch.ones(4) @ torch.ones(4)
with log.without_native_lines("USDT:"):
    prof.stop()
"""


def run_probe(probe: str, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def kineto_writes_usdt() -> bool:
    """Whether this torch's kineto writes its USDT lines at all (torch 2.13 does; 2.11 does not)."""
    raw = PROFILER_PROBE.replace('log.without_native_lines("USDT:")', "contextlib.nullcontext()")
    return "USDT:" in run_probe("import contextlib\n" + raw, dict(os.environ)).stderr


@pytest.mark.parametrize("debug", [None, "1"])
def test_the_profilers_usdt_lines_are_dropped_unless_debug(debug, kineto_writes_usdt):
    """kineto writes "USDT: ... profiler_start" to file descriptor 2 at each start and stop whatever
    KINETO_LOG_LEVEL says: loom drops those lines around the two calls (LOOM_DEBUG=1 keeps them, where this
    torch writes them), and passes every other line on."""
    env = {k: v for k, v in os.environ.items() if k != "LOOM_DEBUG"}
    if debug is not None:
        env["LOOM_DEBUG"] = debug
    r = run_probe(PROFILER_PROBE, env)
    assert "a native error line stays" in r.stderr
    assert ("USDT:" in r.stderr) is (debug is not None and kineto_writes_usdt), r.stderr
