"""`loom bench train`'s record (issue 43): compile_s is the first step timed whole, so no compile may happen
before it, and the profiled forward that measures activation memory, which compiles a compiled model's forward
where it runs first, now runs after the warmup steps; and each record counts the linears that train in float8.

Compared against: the order of the calls themselves (train steps and the profiled forward, recorded by
wrapping them), and the model's own linears (a 2-layer GPT: 6 per block and the head)."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
from tiny import tiny_args

import loom.bench.train as bench_train
from loom.cli import main
from loom.train import Trainer

TINY = [a for a in tiny_args() if a.startswith("--model.")]  # the model only: bench sets the rest
ARGS = ["bench", "train", "--synthetic", "--model.vocab_size=64", *TINY, "--train.batch_size=4"]


def test_the_profiled_forward_runs_after_the_warmup(tmp_path, monkeypatch):
    calls = []
    step, profile = Trainer.train_step, bench_train.activation_bytes
    monkeypatch.setattr(Trainer, "train_step", lambda self: calls.append("step") or step(self))
    monkeypatch.setattr(
        bench_train, "activation_bytes", lambda *a, **k: calls.append("profile") or profile(*a, **k)
    )
    out = tmp_path / "bench.json"
    assert main([*ARGS, "--steps", "2", "--warmup", "2", "--json", str(out)]) == 0
    assert calls == ["step", "step", "profile", "step", "step"]  # warmup, the profiled forward, timed steps
    rec = json.loads(out.read_text())[0]
    assert rec["activation_bytes"] > 0 and rec["fp8_linears"] == 0 and rec["linears"] == 13


@pytest.mark.skipif(find_spec("torchao") is None, reason="needs torchao (the loom[fp8] extra)")
def test_fp8_records_count_the_converted_linears(tmp_path):
    out = tmp_path / "bench.json"
    args = [*ARGS, "--steps", "1", "--warmup", "1", "--rounds", "1", "--precision.fp8_filter=all"]
    assert main([*args, "--fp8", "off,tensorwise", "--json", str(out)]) == 0
    recs = {r["mode"]: r for r in json.loads(out.read_text())}
    assert (recs["off"]["fp8_linears"], recs["off"]["linears"]) == (0, 13)
    assert (recs["tensorwise"]["fp8_linears"], recs["tensorwise"]["linears"]) == (12, 13)  # not the head
