"""The dry run measures each rank in a forked child; where the parent has started autograd's device threads
(torch's CUDA builds after some fake-CUDA work: seen in the torch 2.11 tier) a forked child's backward refuses to
run, and the ranks are measured again in spawned children instead of failing."""

from __future__ import annotations

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
