"""train.batch_schedule and train.seq_schedule (loom.config.schedules): the schedule function against a step by
step sum written here, the data order (every window of the global order read once, in order, whatever the
schedule and the number of data-parallel ranks, compared with ShardLoader.global_rows), the loader's resume
inside the ramp, and each bad input as one LoomError from validate() or the loader, before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.config import load_config, validate
from loom.config.schedules import parse_ramp, step_shape
from loom.data.loader import ShardLoader
from loom.data.slice import DataSlice
from loom.errors import LoomError

BATCH, SEQ = "4@0,8@3,16@6", "8@0,16@4,32@7"


def _cfg(*overrides: str):
    base = ["--model.block_size=32", "--train.batch_size=16", "--train.steps=10"]
    return load_config(None, base + list(overrides))


def test_ramp_values_and_windows_before_equal_the_sum_of_steps():
    shape = step_shape(_cfg(f"--train.batch_schedule={BATCH}", f"--train.seq_schedule={SEQ}").train, 32)
    assert [shape.windows(s) for s in range(9)] == [4, 4, 4, 8, 8, 8, 16, 16, 16]
    assert [shape.seq_len(s) for s in range(9)] == [8, 8, 8, 8, 16, 16, 16, 32, 32]
    for n in range(12):
        assert shape.windows_before(n) == sum(shape.windows(s) for s in range(n)), n
        assert shape.tokens_before(n) == 32 * shape.windows_before(n)
    assert shape.tokens(0) == 4 * 32  # cut into rows of 8, every target kept
    one = step_shape(_cfg(f"--train.seq_schedule={SEQ}").train, 32)  # the batch stays train.batch_size
    assert one.windows(0) == one.windows(9) == 16 and one.windows_before(3) == 48
    assert str(parse_ramp("8@0, 16@200 ,32@400", "train.batch_schedule", "sequences")) == "8@0,16@200,32@400"


def test_toml_list_and_derived_micro_batch():
    cfg = _cfg("--train.batch_schedule=4@0,8@3,16@6")
    derived, _ = validate(cfg, world=2)
    assert derived.micro_batch_size == 2  # the smallest batch over 2 ranks: 2, 4 and 8 micro-steps
    assert derived.grad_accum == 4 and derived.schedule.windows(0) == 4


@pytest.mark.parametrize(
    "world,flags,message",
    [
        (2, ["--train.batch_schedule=5@0,16@4"], "size 5 does not divide over 2 data-parallel rank(s)"),
        (1, ["--train.batch_schedule=4@0,12@3,16@6", "--train.micro_batch_size=8"], "size 4 does not divide"),
        (1, ["--train.batch_schedule=4@0,16@5,8@5,16@9"], "the steps must increase (5 after 5)"),
        (1, ["--train.batch_schedule=4@0,16@9,8@3"], "the steps must increase (3 after 9)"),
        (1, ["--train.batch_schedule=4@2,16@5"], "starts at step 2: the first value must be at step 0"),
        (1, ["--train.seq_schedule=8@3,32@5"], "starts at step 3"),
        (1, ["--train.batch_schedule=4@0,8@5"], "ends at 8 sequences, not at train.batch_size=16"),
        (1, ["--train.batch_schedule=4@0,x@5"], "cannot read 'x@5' as VALUE@STEP"),
        (1, ["--train.batch_schedule=0@0,16@5"], "needs a positive value"),
        (1, ["--train.seq_schedule=64@0,32@5"], "length 64 above model.block_size=32"),
        (1, ["--train.seq_schedule=12@0,32@5"], "length 12 does not divide model.block_size=32"),
        (1, ["--train.seq_schedule=8@0,16@5"], "ends at 16, not at model.block_size=32"),
        (2, ["--train.batch_schedule=8@0,16@5", "--parallel.pp=2"], "cannot be used with parallel.pp=2"),
        (2, ["--train.seq_schedule=8@0,32@5", "--parallel.cp=2"], "cannot be used with parallel.cp=2"),
        (2, ["--train.seq_schedule=8@0,32@5", "--parallel.tp=2"], "cannot be used with parallel.tp=2"),
        (1, ["--train.batch_schedule=8@0,16@5", "--data.mix=a:1"], "cannot be used with data.mix"),
        (
            1,
            ["--train.batch_schedule=8@0,16@5", "--rl.prompts=p.jsonl", "--rl.max_new_tokens=8"],
            "with rl.prompts",
        ),
    ],
)
def test_bad_schedules_are_one_error_before_any_work(world, flags, message):
    with pytest.raises(LoomError) as e:
        validate(_cfg(*flags), world=world)
    assert message in e.value.message, e.value.message
    assert e.value.hint


def _loader(data, schedule, part: DataSlice | None = None):
    return ShardLoader(data, 16, 32, seed=3, part=part or DataSlice(), schedule=schedule)


def test_a_size_above_what_the_data_holds_is_refused(char_data):
    n = ShardLoader(char_data, 16, 32, seed=3).windows.n
    shape = step_shape(_cfg(f"--train.batch_schedule=4@0,{n + 1}@3").train, 32)
    with pytest.raises(LoomError, match=f"asks for {n + 1} sequences in a step; the train split holds {n}"):
        _loader(char_data, shape)


@pytest.mark.parametrize("dp", [1, 2])
def test_each_window_read_once_in_order_across_changes(char_data, dp):
    """Step s of any schedule reads windows [windows_before(s), windows_before(s + 1)) of the global order, rank r
    of dp the r-th share, each window cut into block_size / seq_len(s) consecutive rows: put back together the
    steps are the global order itself, with no window skipped or repeated (into the second epoch too)."""
    shape = step_shape(_cfg(f"--train.batch_schedule={BATCH}", f"--train.seq_schedule={SEQ}").train, 32)
    ranks = [_loader(char_data, shape, DataSlice(r, dp)) for r in range(dp)]
    steps = 2 + ranks[0].windows.n // 16  # past the end of the first epoch
    got = []
    for s in range(steps):
        parts = [loader.next_batch() for loader in ranks]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        assert x.shape == (shape.windows(s) * 32 // shape.seq_len(s), shape.seq_len(s)), s
        got.append(torch.cat([x.reshape(-1, 32), y.reshape(-1, 32)[:, -1:]], dim=1))  # windows again
    want = ranks[0].global_rows(0, shape.windows_before(steps))
    assert torch.equal(torch.cat(got), want)
    assert ranks[0].cursor == shape.windows_before(steps)


def test_loader_resumes_inside_the_ramp(char_data):
    shape = step_shape(_cfg(f"--train.batch_schedule={BATCH}", f"--train.seq_schedule={SEQ}").train, 32)
    a = _loader(char_data, shape)
    for _ in range(5):  # inside the ramp: batch 8 of rows of 16
        a.next_batch()
    state = a.state_dict()
    assert state["step"] == 5 and state["cursor"] == shape.windows_before(5)
    b = _loader(char_data, shape)
    b.load_state_dict(state)
    for s in range(5, 9):  # across both changes
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb), s
    assert np.array_equal(xb.shape, (16, 32))


@pytest.mark.parametrize("kind,meta", [("sft", {"chat": {}}), ("dpo", {"preference": {}})])
def test_chat_and_preference_data_are_refused_before_the_loader(tmp_path, kind, meta):
    from loom.train.stage import build_stage

    cfg = _cfg("--train.batch_schedule=8@0,16@5")
    with pytest.raises(LoomError, match=f"serve pretraining; this run is {kind}"):
        build_stage(cfg, tmp_path, meta, DataSlice(), torch.device("cpu"))
