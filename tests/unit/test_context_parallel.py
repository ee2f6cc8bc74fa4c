"""Context parallel (parallel.cp; issue 30), Ulysses and ring: the rules validate() checks before any process
starts, the rank grid with a cp dimension, the loader's sequence chunks (contiguous for Ulysses, zigzag for
ring) and their positions, Ulysses' two all-to-alls as exact inverses, and ring attention simulated in one
process (the cp ranks as threads passing tensors through queues instead of sends): the online-softmax merge,
the ring's blocks covering the causal mask once, its output and gradients, and a GPT trained on zigzag chunks
(the distributed comparison against one process is tests/distributed/test_cp_ulysses.py).

Compared against: the whole rows (the chunks of cp ranks concatenated), the rank order dp x cp x tp, the
identity (seq_to_head then head_to_seq), and for ring PyTorch's causal scaled_dot_product_attention and the
GPT of one process on whole rows."""

from __future__ import annotations

import copy
import json
import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from loom.config import ParallelDims, load_config, validate
from loom.data.loader import ShardLoader, ValSet, seq_chunk, seq_positions
from loom.data.shards import write_shard
from loom.data.slice import DataSlice
from loom.errors import LoomError
from loom.verify import STRATEGIES

RING = ("--parallel.cp=2", "--parallel.cp_impl=ring")


def _validate(world: int, *overrides: str, dp_impl: str | None = None):
    return validate(load_config(None, list(overrides)), world, dp_impl=dp_impl)


@pytest.mark.parametrize(
    "world,overrides,match",
    [
        (3, ["--parallel.cp=3"], "does not divide model.block_size=128"),
        (8, ["--parallel.cp=8", "--model.block_size=64"], "does not divide model.n_kv_head=4"),
        (2, [*RING, "--model.block_size=30"], r"needs 2\*cp = 4 to divide model.block_size=30"),
        (
            2,
            [*RING, "--data.doc_mask=true"],
            "data.doc_mask=true is not supported with parallel.cp_impl=ring",
        ),
        (2, [*RING, "--model.dropout=0.1"], "model.dropout=0.1 is not supported with parallel.cp_impl=ring"),
        (2, ["--parallel.cp=2", "--parallel.dp_impl=mpi"], "does not compose with parallel.dp_impl=mpi"),
        (4, ["--parallel.cp=2", "--parallel.dp_impl=zero1"], "does not compose with parallel.dp_impl=zero1"),
        (
            8,
            ["--parallel.cp=4", "--parallel.tp=2"],
            "cp=4 x parallel.tp=2 with cp_impl=ulysses does not divide",
        ),
        (
            8,
            [
                "--parallel.cp=4",
                "--parallel.tp=2",
                "--model.n_kv_head=8",
                "--model.n_head=8",
                "--parallel.sp=true",
                "--model.block_size=36",
            ],
            "not divisible by cp x tp = 8",
        ),
        (3, ["--parallel.cp=2"], "not divisible by parallel.cp x tp x pp = 2 x 1 x 1"),
    ],
)
def test_bad_layouts_fail_in_validate(world, overrides, match):
    with pytest.raises(LoomError, match=match) as e:
        _validate(world, *overrides)
    assert e.value.hint or "not divisible" in str(e.value)


def test_rank_grid_with_cp():
    _, dims = _validate(2, "--parallel.cp=2", "--parallel.dp_impl=none")
    assert (dims.dp, dims.cp, dims.dp_impl) == (1, 2, "ddp")  # cp ranks average their gradients
    derived, dims = _validate(4, "--parallel.cp=2")
    assert (dims.dp, dims.cp, dims.dp_impl, dims.rank) == (2, 2, "ddp", 0)
    assert derived.dp_size == 2 and derived.micro_batch_size == 8  # batch 16 splits over dp only, not cp
    grid = [ParallelDims(2, 1, 1, 1, 4, r, "ddp", cp=2) for r in range(4)]
    assert [(d.dp_rank, d.cp_rank) for d in grid] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "cp 2" in grid[0].describe() and "cp=2" in str(grid[0])
    assert "cp" not in ParallelDims().describe()
    s = STRATEGIES["cp-ulysses"]
    assert s.degrees(4) == (1, 1, 1) and s.cp_at(4) == 4 and "--parallel.cp=4" in s.argv(4, [])
    assert STRATEGIES["dp-cp"].degrees(4) == (2, 1, 1) and STRATEGIES["dp-cp"].cp_at(4) == 2


def test_loader_chunks_concatenate_to_the_rows(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50, 5000).astype(np.uint16)
    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", ids, 1)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    whole = ShardLoader(tmp_path, 8, 16, seed=0, part=DataSlice(1, 2)).next_batch()
    parts = [ShardLoader(tmp_path, 8, 16, 0, DataSlice(1, 2, r, 4)).next_batch() for r in range(4)]
    for i in range(2):
        assert torch.equal(torch.cat([p[i] for p in parts], 1), whole[i]) and parts[0][i].shape == (4, 4)
    val = next(ValSet(tmp_path, 16, 4).batches(2))
    val_parts = [next(ValSet(tmp_path, 16, 4, DataSlice(cp_rank=r, cp_size=2)).batches(2)) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in val_parts], 1), val[0])
    assert seq_chunk(whole[0], 0, 1) is whole[0]


def test_ring_rules_differ_from_ulysses():
    """Ring needs 2*cp | block_size but not cp | n_kv_head (its key/value heads are not split); the error for
    2*cp names the degrees that fit."""
    _, dims = _validate(8, "--parallel.cp=8", "--parallel.cp_impl=ring", "--model.block_size=64")
    assert dims.cp == 8 and load_config(None, list(RING)).parallel.cp_layout == "zigzag"
    assert load_config(None, []).parallel.cp_layout == "contiguous"
    _validate(3, "--parallel.cp=3", "--parallel.cp_impl=ring", "--model.block_size=24")  # 6 chunks of 4
    with pytest.raises(LoomError) as e:
        _validate(4, "--parallel.cp=4", "--parallel.cp_impl=ring", "--model.block_size=12")
    assert "pick cp among 2, 3, 6" in e.value.hint


# ----------------------------------------------------------------------------- ring attention, one process
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_layout_and_positions(cp):
    """Rank r holds chunks r and 2cp-1-r of 2cp; seq_chunk of the positions is seq_positions; the ranks
    together hold every token once; contiguous is Ulysses' layout."""
    T = 8 * cp
    whole = torch.arange(T).expand(2, T)
    pos = [seq_positions(T, r, cp, "zigzag") for r in range(cp)]
    c = T // (2 * cp)
    for r in range(cp):
        assert torch.equal(seq_chunk(whole, r, cp, "zigzag"), pos[r].expand(2, -1))
        assert pos[r][:c].tolist() == list(range(r * c, (r + 1) * c))
        assert pos[r][c:].tolist() == list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert torch.equal(seq_chunk(whole, r, cp), seq_positions(T, r, cp).expand(2, -1))
    assert sorted(torch.cat(pos).tolist()) == list(range(T))


def test_loader_zigzag_chunks_are_the_rows_at_their_positions(tmp_path):
    ids = np.random.default_rng(0).integers(0, 50, 5000).astype(np.uint16)
    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", ids, 1)
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    x, y = ShardLoader(tmp_path, 8, 16, seed=0).next_batch()
    for r in range(2):
        xr, yr = ShardLoader(tmp_path, 8, 16, 0, DataSlice(0, 1, r, 2, "zigzag")).next_batch()
        pos = seq_positions(16, r, 2, "zigzag")
        assert torch.equal(xr, x[:, pos]) and torch.equal(yr, y[:, pos])  # targets follow their inputs
        val = next(ValSet(tmp_path, 16, 4, DataSlice(0, 1, r, 2, "zigzag")).batches(2))
        whole = next(ValSet(tmp_path, 16, 4).batches(2))
        assert torch.equal(val[0], whole[0][:, pos]) and torch.equal(val[1], whole[1][:, pos])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_blocks_cover_the_causal_mask_once(cp):
    """Over the cp steps of the ring, the (query, key) pairs each rank computes are exactly the causal ones,
    each once (in whole-sequence positions)."""
    from loom.parallel.ring import block_span

    T = 4 * cp
    n = T // cp
    for rank in range(cp):
        qpos = seq_positions(T, rank, cp, "zigzag")
        count = torch.zeros(n, T, dtype=torch.long)
        for step in range(cp):
            kpos = seq_positions(T, (rank - step) % cp, cp, "zigzag")
            qs, ks, causal = block_span(step, rank, cp, n)
            q_idx, k_idx = torch.arange(n)[qs], torch.arange(n)[ks]
            seen = torch.ones(len(q_idx), len(k_idx), dtype=torch.bool)
            if causal:
                seen = seen.tril()
            count[q_idx[:, None], kpos[k_idx][None, :]] += seen.long()
        assert torch.equal(count, (torch.arange(T)[None, :] <= qpos[:, None]).long()), (cp, rank)


def test_online_softmax_merge_equals_full_attention():
    """Keys cut into disjoint blocks, each attended alone and merged by log-sum-exp: the full softmax
    attention (grouped-query heads), forward and backward."""
    from loom.parallel.ring import attend_block, merge

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 3, 5, 8, generator=g, dtype=torch.double, requires_grad=True)  # (B, K, G, Tq, D)
    k = torch.randn(2, 2, 11, 8, generator=g, dtype=torch.double, requires_grad=True)
    v = torch.randn(2, 2, 11, 8, generator=g, dtype=torch.double, requires_grad=True)
    w = (q @ k.unsqueeze(2).transpose(-2, -1) * 8**-0.5).softmax(-1)
    ref = w @ v.unsqueeze(2)
    out, lse = attend_block(q, k[:, :, :4], v[:, :, :4], False, 8**-0.5)
    for cut in (slice(4, 5), slice(5, 11)):
        out, lse = merge(out, lse, *attend_block(q, k[:, :, cut], v[:, :, cut], False, 8**-0.5))
    assert (out - ref).abs().max() < 1e-12
    gy = torch.randn(ref.shape, generator=g, dtype=torch.double)
    want = torch.autograd.grad(ref, (q, k, v), gy)
    got = torch.autograd.grad(out, (q, k, v), gy)
    for a, b in zip(want, got, strict=True):
        assert (a - b).abs().max() < 1e-12


class _ThreadRing:
    """Ring's interface for cp ranks that are threads of one process: a queue per rank and tag, no sends."""

    def __init__(self, rank: int, size: int, queues: list):
        self.rank, self.size, self.queues = rank, size, queues

    def shift(self, t: torch.Tensor, tag: int = 0):
        self.queues[(self.rank + 1) % self.size][tag].put(t.clone())
        mine = self.queues[self.rank][tag]
        return SimpleNamespace(wait=lambda: mine.get(timeout=60))


def _on_ring(cp: int, fn) -> list:
    """fn(rank, ring) on cp threads at once (they wait for each other's tensors); results in rank order."""
    queues = [[queue.Queue() for _ in range(2)] for _ in range(cp)]
    results, errors = [None] * cp, []

    def run(r):
        try:
            results[r] = fn(r, _ThreadRing(r, cp, queues))
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("tile", [512, 3])  # one tile per block; tiles of 3 query rows (uneven, masked)
@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_equals_causal_attention(cp, tile, monkeypatch):
    """RingAttention on zigzag chunks (grouped-query: 4 query heads over 2 key/value heads) gives, chunk by
    chunk, the output and the q/k/v gradients of causal attention over the whole sequence, whatever the
    number of query rows it computes at a time (ring.TILE)."""
    import torch.nn.functional as F

    from loom.parallel import ring as ring_mod
    from loom.parallel.ring import RingAttention

    monkeypatch.setattr(ring_mod, "TILE", tile)

    g = torch.Generator().manual_seed(cp)
    T = 8 * cp
    q, k, v = (torch.randn(2, h, T, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    gy = torch.randn(2, 4, T, 8, generator=g)
    y = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    want = torch.autograd.grad(y, (q, k, v), gy)

    def rank(r, ring):
        pos = seq_positions(T, r, cp, "zigzag")
        parts = [t.detach()[:, :, pos].requires_grad_() for t in (q, k, v)]
        out = RingAttention.apply(*parts, ring)
        out.backward(gy[:, :, pos])
        return pos, out.detach(), [p.grad for p in parts]

    for pos, out, grads in _on_ring(cp, rank):
        assert (out - y.detach()[:, :, pos]).abs().max() < 1e-5
        for a, b in zip(grads, want, strict=True):
            assert (a - b[:, :, pos]).abs().max() < 1e-5


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_gpt_on_zigzag_chunks_equals_one_process(pos):
    """A GPT whose cp=2 ranks (threads) each hold a zigzag chunk, with ring attention and the chunk's
    positions (the learned table's input, or RoPE's angles): the mean of their losses and gradients (what DDP makes of
    them) equals one process's on whole rows."""
    from loom.model.gpt.gpt import GPT, GPTConfig
    from loom.parallel.ring import apply_ring

    torch.manual_seed(0)
    kw = {"norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2, "qk_norm": True} if pos == "rope" else {}
    model = GPT(GPTConfig(64, n_layer=2, n_head=4, n_embd=32, block_size=16, pos=pos, **kw))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (3, 16), generator=g), torch.randint(0, 64, (3, 16), generator=g)
    ref = model(x, y)
    ref.backward()

    def rank(r, ring):
        m = copy.deepcopy(model)
        m.zero_grad()
        apply_ring(m, list(m.blocks), ring, m.wpe)
        loss = m(seq_chunk(x, r, 2, "zigzag"), seq_chunk(y, r, 2, "zigzag"))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    results = _on_ring(2, rank)
    assert abs(sum(loss for loss, _ in results).item() / 2 - ref.item()) < 1e-6
    for n, p in model.named_parameters():
        assert (sum(grads[n] for _, grads in results) / 2 - p.grad).abs().max() < 1e-6, n
