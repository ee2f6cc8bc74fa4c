"""TritonAdamW against torch.optim.AdamW (single-tensor path): same parameters, moments and steps
after 20 steps with two param groups; one kernel launch per step; state_dicts that load into each other.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set per test: triton reads it when
a kernel is defined, and TritonAdamW defines its kernel per mode on first use). Tensors stay small
because the interpreter runs each program in numpy.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from loom.errors import LoomError


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # 1,300-odd elements in the big matrix: full blocks and a masked tail block in one launch
    return torch.nn.Sequential(torch.nn.Linear(11, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 60))


def _groups(model: torch.nn.Module) -> list[dict]:
    """loom's decay / no-decay split, the second group also with its own lr and betas."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3, "betas": (0.8, 0.9)},
    ]


def _set_grads(models: list[torch.nn.Module], step: int, gen: torch.Generator) -> None:
    """The same random gradient for each model; the LayerNorm bias has none on odd steps (skipped)."""
    for ps in zip(*(m.parameters() for m in models), strict=True):
        skip = step % 2 == 1 and ps[0] is models[0][1].bias
        g = None if skip else torch.randn(ps[0].shape, generator=gen)
        for p in ps:
            p.grad = None if g is None else g.clone()


def _assert_same(ma, oa, mb, ob) -> None:
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-7)
        sa, sb = oa.state[pa], ob.state[pb]
        assert float(sa["step"]) == float(sb["step"])
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(sb["exp_avg_sq"], sa["exp_avg_sq"], rtol=1e-5, atol=1e-7)


def _run(models_opts, steps: int, start: int = 0, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for s in range(start, start + steps):
        _set_grads([m for m, _ in models_opts], s, gen)
        for _, opt in models_opts:
            opt.step()


def test_matches_torch_adamw_over_20_steps(interpret):
    from loom.optim.triton_adamw import TritonAdamW

    ref, mine = _model(), _model()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref_opt = torch.optim.AdamW(_groups(ref), **kw)
    opt = TritonAdamW(_groups(mine), **kw)
    _run([(ref, ref_opt), (mine, opt)], 20)
    _assert_same(ref, ref_opt, mine, opt)
    assert float(opt.state[mine[1].bias]["step"]) == 10  # skipped steps do not count, as in torch
    assert opt.launches == 20


def test_one_kernel_launch_per_step(interpret, monkeypatch):
    from loom.optim import triton_adamw

    launches = []
    real = triton_adamw._kernel

    class Counting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_adamw, "_kernel", lambda: Counting(real()))
    model = _model()
    opt = triton_adamw.TritonAdamW(_groups(model), lr=1e-2)
    _run([(model, opt)], 3)
    blocks = sum(-(-p.numel() // triton_adamw.BLOCK) for p in model.parameters())
    # one launch per step, its grid covering every parameter with a gradient (step 1 skips a bias)
    assert launches == [(blocks,), (blocks - 1,), (blocks,)]
    assert opt.launches == 3


def test_state_dict_round_trip_with_torch(interpret):
    from loom.optim.triton_adamw import TritonAdamW

    kw = dict(lr=1e-2, betas=(0.9, 0.95))
    ref, mine = _model(), _model()
    ref_opt, opt = torch.optim.AdamW(_groups(ref), **kw), TritonAdamW(_groups(mine), **kw)
    _run([(ref, ref_opt), (mine, opt)], 4)

    def reload(opt_from, model_to, cls, **extra):
        buf = io.BytesIO()
        torch.save(opt_from.state_dict(), buf)
        buf.seek(0)
        new = cls(_groups(model_to), **kw, **extra)
        new.load_state_dict(torch.load(buf, weights_only=True))
        return new

    # TritonAdamW's checkpoint into torch's AdamW, torch's into TritonAdamW: both continue identically
    ref2 = _model()
    ref2.load_state_dict(mine.state_dict())
    ref2_opt = reload(opt, ref2, torch.optim.AdamW)
    mine2 = _model()
    mine2.load_state_dict(ref.state_dict())
    mine2_opt = reload(ref_opt, mine2, TritonAdamW)
    assert mine2_opt.param_groups[1]["betas"] == (0.8, 0.9)
    assert ref2_opt.param_groups[0]["decoupled_weight_decay"] is True
    _run([(ref, ref_opt), (mine, opt), (ref2, ref2_opt), (mine2, mine2_opt)], 4, start=4)
    _assert_same(ref, ref_opt, mine2, mine2_opt)
    _assert_same(mine, opt, ref2, ref2_opt)
    _assert_same(ref, ref_opt, mine, opt)


def test_fused_torch_state_and_amsgrad(interpret):
    """A state from torch's fused AdamW (steps on the device) loads; amsgrad state is refused."""
    from loom.optim.triton_adamw import TritonAdamW

    model = _model()
    fused = torch.optim.AdamW(_groups(model), fused=True)
    _run([(model, fused)], 1)
    opt = TritonAdamW(_groups(model))
    opt.load_state_dict(fused.state_dict())
    st = opt.state[model[0].weight]
    assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32
    ams = torch.optim.AdamW(_groups(model), amsgrad=True)
    _run([(model, ams)], 1)
    with pytest.raises(LoomError, match="amsgrad"):
        TritonAdamW(_groups(model)).load_state_dict(ams.state_dict())


def test_build_optimizer_picks_triton(interpret):
    from loom.config import OptimConfig
    from loom.optim.build import build_optimizer
    from loom.optim.triton_adamw import TritonAdamW

    model = _model()
    opt = build_optimizer(model, OptimConfig(impl="triton", weight_decay=0.1), torch.device("cpu"))
    assert isinstance(opt, TritonAdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from loom.optim.triton_adamw import TritonAdamW

    with pytest.raises(LoomError, match="TRITON_INTERPRET") as e:
        TritonAdamW(_model().parameters())
    assert "torch-fused" in e.value.hint


def test_rejects_non_fp32_parameters(interpret):
    from loom.optim.triton_adamw import TritonAdamW

    with pytest.raises(LoomError, match="float32"):
        TritonAdamW(_model().to(torch.bfloat16).parameters())


def test_missing_triton_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    from loom.config import OptimConfig
    from loom.optim.build import build_optimizer

    with pytest.raises(LoomError) as e:
        build_optimizer(_model(), OptimConfig(impl="triton"), torch.device("cpu"))
    assert "pip install 'loom[triton]'" in e.value.hint
