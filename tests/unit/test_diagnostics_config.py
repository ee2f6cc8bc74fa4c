"""The keys of issue 48's diagnostics, checked by validate() before anything runs: the profiler's ranks and the
memory snapshot's steps. Compared against the messages' promises (what is refused, with the remedy)."""

from __future__ import annotations

import pytest

from loom.config import Config, validate
from loom.config.validate import rank_list, step_list
from loom.errors import LoomError


def test_rank_and_step_lists():
    assert rank_list("all", 3) == [0, 1, 2] and rank_list("2, 0", 4) == [0, 2]
    assert step_list("9,5,5", "k") == [5, 9] and step_list("", "k") == []
    with pytest.raises(LoomError, match="ranks 0-1"):
        rank_list("3", 2)
    with pytest.raises(LoomError, match="list of ranks"):
        rank_list("first", 2)
    with pytest.raises(LoomError, match="steps start at 1"):
        step_list("0", "train.memory_snapshot_steps")


def test_validate_refuses_before_running():
    cfg = Config()
    cfg.train.profile_start, cfg.train.profile_ranks = 5, "7"
    with pytest.raises(LoomError, match="train.profile_ranks=7"):
        validate(cfg, world=1)
    cfg = Config()
    cfg.train.memory_snapshot = "steps"
    with pytest.raises(LoomError, match="needs train.memory_snapshot_steps"):
        validate(cfg, world=1)
