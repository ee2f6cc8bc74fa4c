"""ShardLoader and ValSet against the single-process, single-rank loader.

Compared against: the 1-rank loader (dp_size=1) is the reference. dp ranks are simulated in one process by
building one loader per dp_rank; their slices, concatenated in rank order, must equal the 1-rank global
batch at every step, across epoch boundaries and after a resume. Shards hold np.arange tokens, so a token's
value is its position and any row can be traced back to where it was cut.
"""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest
import torch

from loom.data.formats import split_files
from loom.data.loader import ShardLoader, ValSet, WindowOrder
from loom.data.shards import write_shard
from loom.data.slice import DataSlice
from loom.errors import LoomError

T = 4  # block_size
N_WINDOWS = 30  # windows per epoch in the default train split (len // T - 1)
TRAIN_LEN = (N_WINDOWS + 1) * T  # 124 tokens
VAL_LEN = 11 * T  # 10 val windows
B = 12  # divisible by every dp size tested


def make_dir(path, train=(TRAIN_LEN,), val=(VAL_LEN,), offsets=None):
    """A prepared directory: shards of np.arange tokens (shard i starts at offsets[i]) and a minimal meta."""
    path.mkdir(parents=True, exist_ok=True)
    offsets = offsets or [0] * max(len(train), len(val))
    for i, n in enumerate(train):
        write_shard(path / f"train_{i:06d}.bin", np.arange(n) + offsets[i], 1)
    for i, n in enumerate(val):
        write_shard(path / f"val_{i:06d}.bin", np.arange(n) + offsets[i], 1)
    (path / "meta.json").write_text(json.dumps({"format": "llm.c", "vocab_size": 65536}))
    return path


@pytest.fixture
def data_dir(tmp_path):
    return make_dir(tmp_path / "data")


def batches(loader, steps):
    return [loader.next_batch() for _ in range(steps)]


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_rank_slices_are_the_global_batch(data_dir, dp):
    steps = 6  # 72 samples: more than two epochs of 30 windows
    ref = batches(ShardLoader(data_dir, B, T, seed=7), steps)
    ranks = [ShardLoader(data_dir, B, T, seed=7, part=DataSlice(r, dp)) for r in range(dp)]
    per_rank = [batches(ld, steps) for ld in ranks]
    for s in range(steps):
        xs = [per_rank[r][s][0] for r in range(dp)]
        ys = [per_rank[r][s][1] for r in range(dp)]
        assert all(x.shape == (B // dp, T) for x in xs)
        assert torch.equal(torch.cat(xs), ref[s][0])
        assert torch.equal(torch.cat(ys), ref[s][1])
        if (s + 1) * B <= N_WINDOWS:  # inside epoch 0 every row is a distinct window
            firsts = [set(x[:, 0].tolist()) for x in xs]
            assert sum(len(f) for f in firsts) == B
            assert len(set().union(*firsts)) == B  # rank shares are disjoint
    assert all(ld.cursor == steps * B for ld in ranks)


def test_each_epoch_visits_every_window_once(data_dir):
    ld = ShardLoader(data_dir, 1, T, seed=3)
    for epoch in range(3):
        rows = ld.global_rows(epoch * N_WINDOWS, N_WINDOWS)
        starts = rows[:, 0].tolist()
        shift = starts[0] % T
        assert sorted(starts) == [shift + k * T for k in range(N_WINDOWS)]


def test_batch_is_independent_of_micro_batching(data_dir):
    # The loader takes no micro-batch size: the trainer cuts a rank's batch into micro-batches. Reading the
    # same global rows in pieces (across the epoch boundary at 30) gives the same rows as reading them whole.
    assert "micro_batch_size" not in inspect.signature(ShardLoader).parameters
    ld = ShardLoader(data_dir, B, T, seed=5)
    whole = ld.global_rows(24, B)
    for micro in (1, 2, 3, 4, 6):
        fresh = ShardLoader(data_dir, B, T, seed=5)
        pieces = torch.cat([fresh.global_rows(24 + i, micro) for i in range(0, B, micro)])
        assert torch.equal(pieces, whole)
    ref = ShardLoader(data_dir, B, T, seed=5)
    ref.cursor = 24
    assert torch.equal(ref.next_batch()[0], whole[:, :-1])


def test_same_seed_same_batches_other_seed_differs(data_dir):
    a = batches(ShardLoader(data_dir, B, T, seed=1), 3)
    b = batches(ShardLoader(data_dir, B, T, seed=1), 3)
    c = batches(ShardLoader(data_dir, B, T, seed=2), 3)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c, strict=True))


def test_resume_reproduces_next_batches(data_dir):
    ld = ShardLoader(data_dir, B, T, seed=11)
    batches(ld, 2)
    state = ld.state_dict()
    expected = batches(ld, 4)  # crosses the epoch boundary
    resumed = ShardLoader(data_dir, B, T, seed=999)  # the seed comes from the state
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    got = batches(resumed, 4)
    for (x, y), (gx, gy) in zip(expected, got, strict=True):
        assert torch.equal(x, gx) and torch.equal(y, gy)


def test_state_from_dp2_loads_into_dp1(data_dir):
    ranks = [ShardLoader(data_dir, B, T, seed=4, part=DataSlice(r, 2)) for r in range(2)]
    for ld in ranks:
        batches(ld, 2)
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    expected = [torch.cat([ld.next_batch()[0] for ld in ranks]) for _ in range(3)]
    single = ShardLoader(data_dir, B, T, seed=0)
    single.load_state_dict(state)
    for x in expected:
        assert torch.equal(single.next_batch()[0], x)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 30, 64, 65, 1000, 4099, (1 << 16) + 3])
def test_window_order_is_a_permutation_of_any_size(n):
    order = WindowOrder(n, seed=3, epoch=1)
    assert sorted(order[0:n].tolist()) == list(range(n))
    assert np.array_equal(order[np.arange(n)[::-1]], order[0:n][::-1])  # index by index, any order


def test_window_order_depends_on_seed_and_epoch_and_is_cheap_for_huge_n():
    first = WindowOrder(1000, seed=1, epoch=0)[0:1000]
    assert np.array_equal(first, WindowOrder(1000, seed=1, epoch=0)[0:1000])
    for other in (WindowOrder(1000, seed=2, epoch=0), WindowOrder(1000, seed=1, epoch=1)):
        assert (other[0:1000] != first).mean() > 0.9
    assert abs(np.corrcoef(np.arange(1000), first)[0, 1]) < 0.15  # no trace of the identity left
    huge = WindowOrder(10**12, seed=0, epoch=0)  # a trillion windows: nothing of that size is built
    got = huge[np.arange(10_000)]
    assert len(np.unique(got)) == 10_000 and got.min() >= 0 and got.max() < 10**12
    assert got.max() > 9 * 10**11  # spread over the whole range


def test_resume_of_a_state_saved_before_window_order_keeps_its_order(data_dir):
    # A loader state without "order" comes from a checkpoint of the materialized permutation; resuming it
    # reads exactly the windows that order gives (np.random.default_rng([seed, epoch]).permutation).
    ld = ShardLoader(data_dir, B, T, seed=5)
    state = {k: v for k, v in ld.state_dict().items() if k != "order"}
    ld.load_state_dict(state)
    rng = np.random.default_rng([5, 0])
    perm, shift = rng.permutation(N_WINDOWS), int(rng.integers(T))
    assert ld.next_batch()[0][:, 0].tolist() == [shift + int(w) * T for w in perm[:B]]
    assert ld.state_dict()["order"] == "permutation"  # and goes on with it in its next checkpoint
    fresh = ShardLoader(data_dir, B, T, seed=5)
    assert fresh.state_dict()["order"] == "feistel"


def test_load_state_for_other_data_is_refused(data_dir):
    ld = ShardLoader(data_dir, B, T, seed=0)
    other = ShardLoader(data_dir, B, T + 1, seed=0)
    with pytest.raises(LoomError, match="block_size"):
        other.load_state_dict(ld.state_dict())


def test_windows_never_cross_shards(tmp_path):
    # Three shards of different lengths; shard i's tokens start at 10000 * i so a crossing window would jump.
    d = make_dir(tmp_path / "d", train=(37, 22, 50), offsets=[0, 10000, 20000])
    ld = ShardLoader(d, 5, T, seed=0)
    n = ld.windows.n
    assert n == (37 // T - 1) + (22 // T - 1) + (50 // T - 1)
    seen_shards = set()
    for _ in range(4 * n // 5 + 1):  # several epochs, so several shifts
        x, y = ld.next_batch()
        rows = torch.cat([x, y[:, -1:]], dim=1)
        assert (rows[:, 1:] - rows[:, :-1] == 1).all()
        seen_shards.update((rows[:, 0] // 10000).tolist())
    assert seen_shards == {0, 1, 2}


def test_targets_are_inputs_shifted_by_one(data_dir):
    x, y = ShardLoader(data_dir, B, T, seed=0).next_batch()
    assert x.dtype == y.dtype == torch.int64
    assert x.shape == y.shape == (B, T)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # arange data: the next token is the next integer


@pytest.mark.parametrize("block_size", [63, 124, 500])
def test_block_size_larger_than_data(data_dir, block_size):
    # 124 train tokens: a window needs block_size + 1 tokens plus room for a shift of up to block_size - 1.
    with pytest.raises(LoomError, match="block_size"):
        ShardLoader(data_dir, B, block_size, seed=0)


def test_largest_block_size_that_fits(data_dir):
    ld = ShardLoader(data_dir, 1, 62, seed=0)
    assert ld.windows.n == 1
    for _ in range(5):  # each epoch draws a new shift; every window must stay inside the 124 tokens
        x, y = ld.next_batch()
        assert x.shape == (1, 62) and int(y.max()) <= 123 and torch.equal(y, x + 1)


def test_batch_not_divisible_by_dp(data_dir):
    with pytest.raises(LoomError, match="divisible"):
        ShardLoader(data_dir, 10, T, seed=0, part=DataSlice(0, 4))


def _val_rows(vs, micro=3):
    return [
        tuple(torch.cat([x, y[:, -1:]], 1)[i].tolist())
        for x, y in vs.batches(micro)
        for i in range(len(x))
        if y[i, 0] != -1
    ]


def test_valset_covers_each_window_once(data_dir):
    vs = ValSet(data_dir, T, n_rows=1000)
    rows = _val_rows(vs)
    assert vs.total_rows == len(rows) == 10
    assert sorted(r[0] for r in rows) == [k * T for k in range(10)]
    x, y = next(vs.batches(4))
    assert x.shape == (4, T) and torch.equal(x[:, 1:], y[:, :-1])


def test_valset_fewer_rows_spread_without_repeats(data_dir):
    vs = ValSet(data_dir, T, n_rows=4)
    starts = [r[0] for r in _val_rows(vs)]
    assert len(starts) == len(set(starts)) == vs.total_rows == 4
    assert min(starts) == 0 and max(starts) == 9 * T  # evenly spaced over the whole split


@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 3])
def test_valset_every_rank_yields_as_many_batches(data_dir, dp, micro):
    # 7 rows over dp ranks: shares differ by a row; a sharded model's forward needs the same number of batches
    # on every rank, so a rank a row short ends with a padding batch whose targets are all -1 (ignored)
    n_batches = math.ceil(math.ceil(7 / dp) / micro)
    for r in range(dp):
        vs = ValSet(data_dir, T, 7, DataSlice(r, dp))
        batches = list(vs.batches(micro))
        assert len(batches) == n_batches
        real = [y[i] for _, y in batches for i in range(len(y)) if y[i, 0] != -1]
        assert len(real) == len(vs.ids)
        assert all((y == -1).all() for _, y in batches[-(-len(vs.ids) // micro) :])


def test_a_padding_batch_changes_no_val_loss(data_dir):
    from loom.eval.val_loss import val_loss
    from loom.model.gpt.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, n_layer=1, n_head=1, n_embd=8, block_size=T))
    short = ValSet(data_dir, T, 7, DataSlice(1, 2))  # 3 rows where rank 0 has 4: one padding batch at micro 1
    assert len(list(short.batches(1))) == 4
    assert val_loss(model, short, 1, "cpu") == pytest.approx(val_loss(model, short, 4, "cpu"), rel=1e-6)


@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("n_rows", [7, 1000])
def test_valset_rank_shares(data_dir, dp, n_rows):
    full = _val_rows(ValSet(data_dir, T, n_rows))
    shares = [_val_rows(ValSet(data_dir, T, n_rows, DataSlice(r, dp))) for r in range(dp)]
    assert sum(len(s) for s in shares) == len(full)
    assert set().union(*map(set, shares)) == set(full)
    for i in range(dp):
        for j in range(i + 1, dp):
            assert not set(shares[i]) & set(shares[j])


def test_split_files_order(tmp_path):
    d = make_dir(tmp_path / "d", train=(20, 20, 20))
    assert [p.name for p in split_files(d, "train")] == [f"train_{i:06d}.bin" for i in range(3)]


def test_split_files_not_a_directory(tmp_path):
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(LoomError, match="not a directory"):
        split_files(f, "train")
    with pytest.raises(LoomError, match="not a directory"):
        split_files(tmp_path / "missing", "train")


def test_split_files_without_meta(tmp_path):
    d = make_dir(tmp_path / "d")
    (d / "meta.json").unlink()
    with pytest.raises(LoomError, match="no meta.json"):
        split_files(d, "train")


def test_split_files_without_val_shards(tmp_path):
    d = make_dir(tmp_path / "d", val=())
    assert split_files(d, "train")
    with pytest.raises(LoomError, match="no val shards"):
        split_files(d, "val")
    with pytest.raises(LoomError, match="no val shards"):
        ValSet(d, T, 10)
