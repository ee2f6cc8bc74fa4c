"""benchmarks/time_to_quality.py's ablation options, without nanoGPT: --variant NAME=ARGS parses into loom
overrides or a config then overrides, a bad name is refused, and the time to target is the first evaluation at
or below it (else the last one, marked not reached)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def ttq():
    sys.path.insert(0, str(BENCH))  # it imports vs_nanogpt beside it
    try:
        spec = importlib.util.spec_from_file_location("time_to_quality", BENCH / "time_to_quality.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


def test_variant_parses_overrides_and_refuses_bad_names(ttq):
    assert ttq._variant("recipe=") == ("recipe", [])
    assert ttq._variant("old=--train.steps=500 --optim.lr=1e-3") == (
        "old",
        ["--train.steps=500", "--optim.lr=1e-3"],
    )
    assert ttq._variant("other=configs/x.toml --train.steps=5") == (
        "other",
        ["configs/x.toml", "--train.steps=5"],
    )
    for bad in ("=--train.steps=5", "nanoGPT=--x=1", "two words=--x=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            ttq._variant(bad)


def test_time_to_target_is_the_first_eval_at_or_below(ttq):
    evals = [(50, 2.0, 5.0), (100, 1.886, 9.0), (150, 1.8, 13.0)]  # (step, val loss, running time)
    assert ttq.time_to_target(evals, 1.886) == (9.0, 100, True)
    assert ttq.time_to_target(evals, 1.0) == (13.0, 150, False)
