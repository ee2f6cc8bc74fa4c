"""TritonAdamW compiled for the GPU (not Triton's interpreter) against torch.optim.AdamW on CUDA: the same
parameters and moments after 20 steps with two param groups, one kernel launch per step, and state_dicts
that load into each other and continue identically. The CPU twin is tests/unit/test_triton_adamw.py.
Skipped without CUDA or without the triton extra."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    pytest.importorskip("triton", reason="the triton extra: pip install 'loom[triton]'")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the real GPU kernel


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # a few hundred thousand elements: many blocks per tensor and a masked tail
    return torch.nn.Sequential(
        torch.nn.Linear(257, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 301)
    ).cuda()


def _groups(model):
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.9)},
    ]


def _run(models_opts, steps: int, start: int = 0) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(start, start + steps):
        for ps in zip(*(m.parameters() for m, _ in models_opts), strict=True):
            g = torch.randn(ps[0].shape, generator=gen, device="cuda")
            for p in ps:
                p.grad = g.clone()
        for _, opt in models_opts:
            opt.step()


def _assert_same(ma, oa, mb, ob) -> None:
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, **TOL)
        sa, sb = oa.state[pa], ob.state[pb]
        assert float(sa["step"]) == float(sb["step"])
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], **TOL)
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], **TOL)


def test_matches_torch_adamw_on_cuda():
    from loom.optim.triton_adamw import TritonAdamW

    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref, mine = _model(), _model()
    ref_opt, opt = torch.optim.AdamW(_groups(ref), foreach=False, **kw), TritonAdamW(_groups(mine), **kw)
    _run([(ref, ref_opt), (mine, opt)], 20)
    _assert_same(ref, ref_opt, mine, opt)
    assert opt.launches == 20
    assert all(s["exp_avg"].device.type == "cuda" for s in opt.state.values())


def test_state_dicts_are_interchangeable_on_cuda():
    from loom.optim.triton_adamw import TritonAdamW

    kw = dict(lr=1e-2, betas=(0.9, 0.95))
    ref, mine = _model(), _model()
    ref_opt, opt = torch.optim.AdamW(_groups(ref), foreach=False, **kw), TritonAdamW(_groups(mine), **kw)
    _run([(ref, ref_opt), (mine, opt)], 4)
    ref2, mine2 = _model(), _model()
    ref2.load_state_dict(mine.state_dict())
    mine2.load_state_dict(ref.state_dict())
    ref2_opt = torch.optim.AdamW(_groups(ref2), foreach=False, **kw)
    ref2_opt.load_state_dict(opt.state_dict())  # Triton's checkpoint into torch's AdamW
    mine2_opt = TritonAdamW(_groups(mine2), **kw)
    mine2_opt.load_state_dict(ref_opt.state_dict())  # and torch's into TritonAdamW
    _run([(ref, ref_opt), (mine, opt), (ref2, ref2_opt), (mine2, mine2_opt)], 4, start=4)
    _assert_same(ref, ref_opt, mine2, mine2_opt)
    _assert_same(mine, opt, ref2, ref2_opt)
