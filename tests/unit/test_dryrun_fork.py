"""The dry run measures each rank in a forked child; where the parent has started autograd's device threads
(torch's CUDA builds after some fake-CUDA work: seen in the torch 2.11 tier) a forked child's backward refuses to
run, and the ranks are measured again in spawned children instead of failing."""

from __future__ import annotations

import dataclasses

import pytest

from loom.dryrun import blocks


def test_a_refused_fork_is_measured_again_in_spawned_children(monkeypatch):
    used = []

    def measure_in(ctx, jobs, workers):
        used.append(ctx.get_start_method())
        if ctx.get_start_method() == "fork":
            raise blocks._ForkRefused(
                "RuntimeError: ... See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork"
            )
        return ["measured"] * len(jobs)

    monkeypatch.setattr(blocks, "_measure_in", measure_in)
    assert blocks.measure_apart([("job",)], workers=1) == ["measured"]
    assert used == ["fork", "spawn"]


def test_the_child_s_refusal_is_told_apart_from_other_failures():
    class Conn:
        def __init__(self, value):
            self.value = value

        def recv(self):
            return self.value

        def close(self):
            pass

    class Proc:
        def join(self):
            pass

    refused = (
        "Traceback ...\nRuntimeError: Unable to handle autograd's threading ... wiki/Autograd-and-Fork\n"
    )
    with pytest.raises(blocks._ForkRefused):
        blocks._received(Conn(("error", refused)), Proc(), 0)
    with pytest.raises(RuntimeError, match="the dry run of rank 0 failed"):
        blocks._received(Conn(("error", "Traceback ...\nValueError: x\n")), Proc(), 0)


def _segfault(*job):
    import faulthandler
    import os
    import signal

    faulthandler.disable()  # pytest's would print this deliberate crash's traceback into the suite's output
    os.kill(os.getpid(), signal.SIGSEGV)


def test_a_forked_child_that_dies_of_a_signal_is_measured_again_spawned(monkeypatch):
    """A fork copies the parent's memory but not its threads: a library thread holding a lock or a pool at the
    fork can crash the child (the torch 2.11 tier's -11, after other tests' threads in the same pytest worker).
    Here the forked child inherits a measure_rank that kills it with SIGSEGV; the spawned child imports loom
    afresh and measures for real, the same bytes as a clean run."""
    from loom.config import load_config

    cfg = load_config(
        None, ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=8"]
    )
    job = (cfg, 1, 0, 64, "fp32", None)
    clean = blocks.measure_apart([job], 1)[0]
    monkeypatch.setattr(blocks, "measure_rank", _segfault)
    again = blocks.measure_apart([job], 1)[0]
    assert dataclasses.replace(again, seconds=clean.seconds) == clean  # all but the time it took


def test_a_spawned_child_that_dies_is_an_error_naming_the_rank():
    class Conn:
        def recv(self):
            raise EOFError

        def close(self):
            pass

    class Proc:
        exitcode = -11

        def join(self):
            pass

    with pytest.raises(blocks._ForkRefused):
        blocks._received(Conn(), Proc(), 3, forked=True)
    with pytest.raises(
        RuntimeError, match=r"rank 3 failed:\nthe process measuring rank 3 died \(exit code -11\)"
    ):
        blocks._received(Conn(), Proc(), 3, forked=False)
