"""Muon (loom.optim.muon) against an SVD: its Newton-Schulz iteration approximates U V^T of the matrix; the
parameter split sends exactly the hidden Linear weights to Muon; its state round-trips through state_dict so a
resumed step equals an uninterrupted one; and the WSD schedule's shape."""

from __future__ import annotations

import copy

import pytest
import torch

from loom.config import Config
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.optim.build import build_optimizer, muon_param_groups
from loom.optim.muon import Muon, newton_schulz
from loom.optim.schedule import lr_at


@pytest.mark.parametrize("shape", [(64, 64), (48, 96), (160, 40)])
def test_newton_schulz_approximates_the_svd_orthogonal_factor(shape):
    g = torch.Generator().manual_seed(0)
    m = torch.randn(shape, generator=g, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    polar = u @ vh  # the exact U V^T
    o = newton_schulz(m.float(), steps=5).double()
    # Same directions: in the SVD basis of m, o is diagonal (to fp32 rounding) ...
    d = u.T @ o @ vh.T
    off = d - torch.diag(torch.diagonal(d))
    assert off.norm() / d.norm() < 1e-3
    # ... with gains near 1, not 1: the quintic's coefficients put every singular value that starts above
    # ~1e-3 of the Frobenius norm between ~0.68 and ~1.21 after five steps (a random square matrix has one
    # far smaller, which stays small), and none above.
    gain, rel = torch.diagonal(d), s / s.norm()
    assert gain[rel > 1e-3].min() > 0.6 and gain.max() < 1.3, gain
    assert (rel > 1e-3).sum() >= min(shape) - 1
    # ... and as a whole close to U V^T (cosine of the two matrices).
    cos = (o * polar).sum() / (o.norm() * polar.norm())
    assert cos > 0.97, cos
    # More iterations do not move it away (the iteration is stable on its range).
    assert torch.linalg.svdvals(newton_schulz(m.float(), steps=12).double()).max() < 1.3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16, block_size=8, bias=True))


def test_hidden_matrices_go_to_muon_the_rest_to_adamw():
    model, cfg = _gpt(), Config().optim
    cfg.name, cfg.lr, cfg.muon_lr = "muon", 1e-3, 0.02
    muon, decay, no_decay = muon_param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    got = sorted(names[id(p)] for p in muon["params"])
    want = sorted(
        n for n, p in model.named_parameters() if n.startswith("blocks.") and n.endswith("_proj.weight")
    )
    assert got == want and len(want) == 2 * 6
    rest = {names[id(p)] for p in decay["params"]}
    assert "wte.weight" in rest and "wpe.weight" in rest  # the tied head is the embedding: AdamW
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert muon["lr_scale"] == pytest.approx(20.0) and decay["lr_scale"] == 1.0
    n = len(muon["params"]) + len(decay["params"]) + len(no_decay["params"])
    assert n == len(list(model.parameters()))


def _steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 50, (4, 8), generator=g)
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_muon_state_dict_resumes_bit_exact():
    cfg = Config().optim
    cfg.name, cfg.muon_weight_decay = "muon", 0.01
    a = _gpt()
    opt_a = build_optimizer(a, cfg, torch.device("cpu"))
    assert isinstance(opt_a, Muon)
    _steps(a, opt_a, 3, seed=1)
    saved_model = {k: v.clone() for k, v in a.state_dict().items()}
    saved_opt = copy.deepcopy(opt_a.state_dict())  # state_dict() holds the live tensors
    kinds = {tuple(sorted(s)) for s in saved_opt["state"].values()}
    assert kinds == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}
    _steps(a, opt_a, 2, seed=2)
    b = _gpt()
    b.load_state_dict(saved_model)
    opt_b = build_optimizer(b, cfg, torch.device("cpu"))
    opt_b.load_state_dict(saved_opt)
    _steps(b, opt_b, 2, seed=2)
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), n


def test_muon_step_at_zero_lr_changes_nothing():
    """DCP's get_optimizer_state_dict initialises empty state by a step at lr 0: it must not move weights."""
    model, cfg = _gpt(), Config().optim
    cfg.name = "muon"
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_wsd_schedule_holds_then_decays_linearly():
    lrs = [lr_at(s, 1.0, 0.1, 2, 10, "wsd", 0.3) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2:7] == [1.0] * 5
    assert lrs[-1] == pytest.approx(0.1) and lrs[7] > lrs[8] > lrs[9]
    assert lr_at(5, 1.0, 0.1, 2, 10) < 1.0  # cosine stays the default


def test_bf16_newton_schulz_batches_by_shape():
    """optim.muon_ns_dtype=bf16: each matrix's step equals newton_schulz of that matrix alone in bf16 (the batch
    of same-shaped matrices changes nothing but the number of kernel calls), close to the fp32 step, and the
    optimizer's bf16 step is that; fp32 stays the default."""
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(shape, generator=g) for shape in [(16, 16)] * 3 + [(64, 16)] * 2 + [(16, 64)]]
    batched = Muon._orthogonalized(dict(enumerate(mats)), 5, "bf16")
    for i, m in enumerate(mats):
        alone = newton_schulz(m, 5, dtype=torch.bfloat16)
        assert alone.dtype == torch.float32 and batched[i].shape == m.shape
        torch.testing.assert_close(batched[i], alone, rtol=0, atol=2e-2)  # bf16's rounding, batched or not
        assert (batched[i] - newton_schulz(m, 5)).norm() / newton_schulz(m, 5).norm() < 0.05
    cfg = Config().optim
    assert cfg.muon_ns_dtype == "fp32"
    cfg.name, cfg.muon_ns_dtype = "muon", "bf16"
    model = _gpt()
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    assert [grp["ns_dtype"] for grp in opt.param_groups] == ["bf16"] * len(opt.param_groups)
    ref = copy.deepcopy(model)
    _steps(model, opt, 1, seed=3)
    _steps(ref, _manual_bf16_muon(ref, cfg), 1, seed=3)
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)


def _manual_bf16_muon(model, cfg):
    """The same optimizer with its Muon matrices orthogonalised one at a time in bf16."""
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    opt._orthogonalized = lambda updates, steps, _: {
        p: newton_schulz(u, steps, dtype=torch.bfloat16) for p, u in updates.items()
    }
    return opt


def test_muon_ns_dtype_choices_are_checked():
    from loom.config import load_config
    from loom.errors import LoomError

    assert load_config(None, ["--optim.muon_ns_dtype=bf16"]).optim.muon_ns_dtype == "bf16"
    with pytest.raises(LoomError, match="muon_ns_dtype"):
        load_config(None, ["--optim.muon_ns_dtype=fp16"])
