"""Context parallel with real processes (gloo, loopback): one `loom verify --strategies cp-ulysses,cp-ring`
(one reference run shared by both) against one process (losses and parameters to 1e-5 in fp32), on a
Llama-family model with grouped-query attention and RoPE (Ulysses' all-to-all splits query and key/value
heads; ring attention passes the key/value heads around and holds zigzag chunks; RoPE turns each token by
its place in the whole sequence). Ulysses' all-to-alls are also checked as inverses of each other on 2
ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from gloo_ranks import spawn_gloo
from loomrun import verify_records


def test_verify_cp_ulysses_and_ring_llama(tmp_path, char_data):
    recs = verify_records(
        tmp_path, char_data, "cp-ulysses,cp-ring", "--model.family=llama", "--model.n_kv_head=2"
    )
    assert all(r["cp"] == 2 for r in recs)


def _round_trip(rank: int, world: int) -> None:
    from loom.parallel.context import HeadToSeq, SeqToHead

    g = torch.Generator().manual_seed(0)
    whole = torch.randn(2, 8, 12, generator=g)  # (B, T, H*D): 4 heads of 3
    x = whole[:, rank * 4 : (rank + 1) * 4].clone().requires_grad_()  # this rank's 4 tokens
    y = SeqToHead.apply(x, dist.group.WORLD)
    assert torch.equal(y, whole[:, :, rank * 6 : (rank + 1) * 6])  # every token, this rank's 2 heads
    back = HeadToSeq.apply(y * 2, dist.group.WORLD)
    assert torch.equal(back, x * 2)
    back.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_all_to_alls_are_inverses(tmp_path):
    spawn_gloo(_round_trip, 2, tmp_path)


def _doc_model(pos: str):
    from loom.model.gpt.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    kw = {"norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2} if pos == "rope" else {}
    cfg = GPTConfig(64, 2, 4, 32, 32, pos=pos, doc_mask=True, eot_id=0, doc_positions="restart", **kw)
    return GPT(cfg)


def _doc_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 6, (3, 32), generator=g)  # id 0 (end-of-text) often: several documents a row
    return x, torch.randint(0, 64, (3, 32), generator=g)


def _doc_masked(rank: int, world: int, out: str) -> None:
    from loom.parallel.context import apply_ulysses

    results = []
    for pos in ("learned", "rope"):
        m = _doc_model(pos)
        apply_ulysses(m, list(m.blocks), dist.group.WORLD, rank, m.wpe, doc_mask=True)
        x, y = _doc_batch()
        n = x.size(1) // world
        loss = m(x[:, rank * n : (rank + 1) * n], y[:, rank * n : (rank + 1) * n])
        loss.backward()
        for p in m.parameters():  # what DDP does over the cp ranks: the mean gradient
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.all_reduce(loss.detach())
        results.append((loss.item() / world, {k: p.grad for k, p in m.named_parameters()}))
    if rank == 0:
        torch.save(results, out)


def test_doc_mask_under_ulysses_equals_one_process(tmp_path):
    """Documents found in the whole sequence (ids all-gathered over cp), positions restarting per document:
    loss and gradients equal one process's (learned positions, and RoPE with grouped-query attention)."""
    out = str(tmp_path / "out.pt")
    spawn_gloo(_doc_masked, 2, tmp_path, out)
    for pos, (loss, grads) in zip(("learned", "rope"), torch.load(out), strict=True):
        m = _doc_model(pos)
        ref = m(*_doc_batch())
        ref.backward()
        assert abs(ref.item() - loss) <= 1e-6, pos
        for k, p in m.named_parameters():
            assert (p.grad - grads[k]).abs().max() <= 1e-6, (pos, k)
