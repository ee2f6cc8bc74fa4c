"""MPI data parallelism against the single-process reference, on this world size.

Every rank computes the full-batch gradient itself (the reference), then each synchroniser's
gradient from its own slice of the batch; they must agree to float32 tolerance, and the naive and
bucketed synchronisers must agree to 1e-7. Also: broadcast_state, no_sync accumulation (no message
sent before the last micro-step), a few SGD steps equal to single-process training, and errors.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import torch
import torch.nn.functional as F
from _common import CountingComm, run
from torch import nn

from loom.errors import LoomError
from loom.parallel.collectives import ring_allreduce
from loom.parallel.mpi_dp import BucketedSync, NaiveSync, cuda_aware_mpi, mpi_comm

VOCAB, T, D = 11, 6, 16
RTOL, ATOL = 1e-5, 1e-6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    def loss(self, x, y):
        return F.mse_loss(self.net(x), y)


class TinyLM(nn.Module):
    """A one-block transformer-like model with a tied head, a frozen parameter, a buffer and an unused parameter."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(3))  # never used: contributes zeros, never blocks a hang
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        self.fc, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.gain = nn.Parameter(torch.ones(D), requires_grad=False)
        self.register_buffer("scale", torch.tensor(1.0))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied

    def loss(self, idx, targets):
        B = idx.shape[0]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        h = self.ln1(x)
        q, k, v = (
            proj(h).view(B, T, -1, 4).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.o_proj(a)
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x))))
        logits = self.head(self.ln_f(x) * self.gain * self.scale)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def broadcast_state(model: nn.Module, comm, root: int = 0) -> None:
    """(A fixture: loom's ranks start equal from seeded initialisation.) Copy every parameter and buffer of `model` from rank `root` to all ranks (in place).

    Tensors are sent as raw bytes, so any dtype works (bfloat16, bool). Tied parameters are sent
    once. CUDA tensors are staged through host memory: this runs once per training run.
    """
    from mpi4py import MPI

    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if t.numel() == 0:
                continue
            host = (
                t.detach()
                if t.device.type == "cpu" and t.is_contiguous()
                else t.detach().to("cpu").contiguous()
            )
            comm.Bcast([host.reshape(-1).view(torch.uint8).numpy(), MPI.BYTE], root=root)
            if host.data_ptr() != t.data_ptr():
                t.copy_(host)


def batch(kind, n):
    g = torch.Generator().manual_seed(1234 + n)
    if kind == "mlp":
        return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    idx = torch.randint(0, VOCAB, (n, T), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def make_model(kind, comm):
    torch.manual_seed(100 + comm.Get_rank())  # a different init on each rank: broadcast_state must fix it
    model = MLP() if kind == "mlp" else TinyLM()
    if kind == "lm":
        model.scale.fill_(comm.Get_rank() + 1.0)
    broadcast_state(model, comm)
    flat = torch.cat([t.detach().reshape(-1) for t in [*model.parameters(), *model.buffers()]]).numpy()
    everyone = np.empty((comm.Get_size(), flat.size), dtype=flat.dtype)
    comm.Allgather(flat, everyone)
    assert (everyone == everyone[0]).all(), "broadcast_state left ranks different"
    if kind == "lm":
        assert model.scale.item() == 1.0 and model.head.weight is model.wte.weight
    return model


def grads(model):
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def reference_grads(model, kind, n):
    ref = copy.deepcopy(model)
    ref.loss(*batch(kind, n)).backward()
    return grads(ref)


def local_slice(comm, tensors, start=0, stop=None):
    p, r = comm.Get_size(), comm.Get_rank()
    n = tensors[0].shape[0] // p
    return [t[r * n : (r + 1) * n][start:stop] for t in tensors]


def assert_close(got, want, what, rtol=RTOL, atol=ATOL):
    for name in want:
        if not torch.allclose(got[name], want[name], rtol=rtol, atol=atol):
            diff = (got[name] - want[name]).abs().max().item()
            raise AssertionError(f"{what}: {name} differs from the reference by {diff:.3g}")


def syncs(model, comm):
    """(label, model copy, synchroniser) for every implementation; small buckets so there are several."""
    out = []
    for label, make in [
        ("naive", lambda m: NaiveSync(m, comm)),
        ("bucket-mpi", lambda m: BucketedSync(m, comm, bucket_mb=0.002)),
        ("bucket-mpi-one", lambda m: BucketedSync(m, comm)),
        ("bucket-ring", lambda m: BucketedSync(m, comm, bucket_mb=0.002, allreduce="ring")),
    ]:
        m = copy.deepcopy(model)
        out.append((label, m, make(m)))
    return out


def check_sync(comm, kind, B):
    model = make_model(kind, comm)
    want = reference_grads(model, kind, B)
    results = {}
    for label, m, sync in syncs(model, comm):
        if isinstance(sync, BucketedSync):
            assert len(sync.buckets) == (1 if label.endswith("one") else len(sync.buckets)) >= 1
            n_params = sum(len(b.params) for b in sync.buckets)
            assert n_params == sum(1 for p in m.parameters() if p.requires_grad), "tied/frozen handling"
        m.loss(*local_slice(comm, batch(kind, B))).backward()
        if isinstance(sync, BucketedSync) and kind == "mlp":
            # Every bucket's all-reduce was started by the hooks during backward, not by wait().
            assert sync.started == len(sync.buckets), (label, sync.started, len(sync.buckets))
            assert label.endswith("one") or len(sync.buckets) > 1
        sync.sync()
        results[label] = grads(m)
        assert_close(results[label], want, f"{kind} {label}")
    for label in ("bucket-mpi", "bucket-mpi-one", "bucket-ring"):
        # Different algorithms add in different orders: allow 1e-7 plus 2 ulp of float32.
        assert_close(results[label], results["naive"], f"{kind} naive vs {label}", rtol=2**-22, atol=1e-7)
        if comm.Get_rank() == 0:
            diff = max((results[label][k] - results["naive"][k]).abs().max().item() for k in want)
            print(f"{kind} max |naive - {label}| = {diff:.3g}", flush=True)
    if comm.Get_size() == 2:  # a + b == b + a: same bits whichever algorithm
        for label in ("bucket-mpi", "bucket-mpi-one", "bucket-ring"):
            assert all(torch.equal(results[label][k], results["naive"][k]) for k in want), label


def check_accumulation(comm, kind, B=36, K=3):
    model = make_model(kind, comm)
    want = reference_grads(model, kind, B)
    for label, m, sync in syncs(model, comm):
        counting = CountingComm(comm)
        sync.comm = counting
        micro = B // comm.Get_size() // K
        for k in range(K):
            xs = local_slice(comm, batch(kind, B), k * micro, (k + 1) * micro)
            if k < K - 1:
                with sync.no_sync():
                    (m.loss(*xs) / K).backward()
                    sync.sync()  # does nothing inside no_sync
                assert counting.total() == 0, f"{label} communicated inside no_sync: {counting.calls}"
            else:
                (m.loss(*xs) / K).backward()
                sync.sync()
        assert counting.total() > 0 or comm.Get_size() == 1
        assert sync.require_sync
        assert_close(grads(m), want, f"{kind} accumulation {label}")


def check_training(comm, steps=3, B=12):
    """A few SGD steps with BucketedSync equal single-process full-batch training."""
    model = make_model("lm", comm)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sync = BucketedSync(model, comm, bucket_mb=0.002)
    for step in range(steps):
        data = batch("lm", B + step)[0][:B], batch("lm", B + step)[1][:B]
        opt_ref.zero_grad()
        ref.loss(*data).backward()
        opt_ref.step()
        opt.zero_grad()
        model.loss(*local_slice(comm, data)).backward()
        sync.wait()
        opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"training: {name} drifted from the reference"


def check_misc(comm):
    try:
        BucketedSync(MLP(), comm, bucket_mb=0)
    except LoomError as e:
        assert e.hint
    else:
        raise AssertionError("bucket_mb=0 accepted")
    try:
        BucketedSync(MLP(), comm, allreduce="nccl")
    except LoomError:
        pass
    else:
        raise AssertionError("allreduce='nccl' accepted")

    # A second synchronised backward before wait() is a mistake that must not pass silently.
    model = make_model("mlp", comm)
    sync = BucketedSync(model, comm, bucket_mb=0.002)
    xs = local_slice(comm, batch("mlp", 12))
    model.loss(*xs).backward()
    try:
        model.loss(*xs).backward()
    except LoomError:
        pass
    else:
        raise AssertionError("double backward before wait() accepted")
    sync.wait()  # completes the requests started by the first backward

    # The ring all-reduce works in place on CPU torch tensors through their numpy view.
    t = torch.arange(10, dtype=torch.float32) * (comm.Get_rank() + 1)
    assert ring_allreduce(comm, t) is t
    size = comm.Get_size()
    assert torch.equal(t, torch.arange(10, dtype=torch.float32) * (size * (size + 1) // 2))

    assert mpi_comm().Get_size() == size
    assert cuda_aware_mpi() is False  # no CUDA-enabled MPI on the CPU test machines


def main(comm):
    torch.set_num_threads(1)
    check_misc(comm)
    check_sync(comm, "mlp", B=12)
    check_sync(comm, "lm", B=12)
    check_accumulation(comm, "mlp")
    check_accumulation(comm, "lm")
    check_training(comm)


if __name__ == "__main__":
    run(main)
