"""train.profile_* on 2 real processes (issue 48, item 2): steps 5-7 traced, one Chrome trace per rank named by
step and rank, whose events include loom's phase marks; the path printed. Compared against the marks the
trainer sets (loom/data, forward, backward, comm, optimizer, checkpoint) and the file names documented."""

from __future__ import annotations

import json

from faultkit import Proc, train_args

MARKS = {"loom/data", "loom/forward", "loom/backward", "loom/comm", "loom/optimizer", "loom/checkpoint"}


def test_profile_of_steps_5_to_7_on_two_ranks(char_data, tmp_path):
    args = [
        *train_args(char_data, tmp_path, "prof", 8),
        "--train.profile_start=5",
        "--train.profile_steps=3",
        "--train.profile_ranks=all",
        "--nproc",
        "2",
    ]
    p = Proc(args, tmp_path / "out")
    assert p.wait() == 0, p.stderr()[-3000:]
    folder = tmp_path / "prof" / "profile"
    traces = sorted(f.name for f in folder.iterdir())
    assert traces == ["trace_step5-7_rank0.json", "trace_step5-7_rank1.json"], traces
    for name in traces:
        events = json.loads((folder / name).read_text())["traceEvents"]
        names = {e.get("name") for e in events}
        assert MARKS <= names, MARKS - names
        assert sum(e.get("name") == "loom/forward" for e in events) == 3  # one per traced step
    assert f"profile of steps 5-7 (ranks 0,1): {folder / traces[0]}" in p.stdout() + p.stderr()
