"""FP8 through torchao (loom.parallel.fp8), one process: which linears convert and why, checkpoints unchanged
by it, evaluation in high precision, the LM head's padding mask kept, and each bad input refused before a
model exists."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from loom.config import load_config, validate
from loom.errors import LoomError
from loom.model.registry import spec_of
from loom.parallel import fp8, parallelize

pytest.importorskip("torchao.float8", reason="the loom[fp8] extra (torchao) is not installed")

SMALL = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16"]


def _par(*flags: str):
    cfg = load_config(None, [*SMALL, "--train.device=cpu", *flags])
    dims = validate(cfg)[1]
    spec = spec_of(cfg)
    model = spec.build_model(cfg, 60)  # vocabulary 60, padded to 64: the head masks 4 rows
    cpu = torch.device("cpu")
    return cfg, parallelize(model, dims, cfg, cpu, spec, init=lambda n, w: model.init_param(n, w, 0))


@pytest.mark.parametrize(
    "shape, recipe, filt, head, want",
    [
        ((64, 32), "tensorwise", "all", False, True),
        ((64, 24), "tensorwise", "all", False, False),  # 24 is no multiple of 16: float8 matmuls cannot
        ((1024, 4096), "tensorwise", "auto", False, False),  # torchao's H100 threshold: too small to gain
        ((1024, 8192), "tensorwise", "auto", False, True),
        ((4096, 2048), "rowwise", "auto", False, False),
        ((8192, 2048), "rowwise", "auto", False, True),
    ],
)
def test_select_rule(shape, recipe, filt, head, want):
    out, inp = shape
    assert fp8.select(recipe, head, filt)(nn.Linear(inp, out, device="meta"), "blocks.0.mlp.up_proj") is want


def test_head_only_when_asked():
    lin = nn.Linear(32, 64, device="meta")
    assert not fp8.select("tensorwise", False, "all")(lin, "lm_head")
    assert fp8.select("tensorwise", True, "all")(lin, "lm_head")
    assert not fp8.select("tensorwise", True, "all")(nn.Embedding(64, 32), "wte")


@pytest.mark.parametrize(
    "flags, hint",
    [
        ([], "precision.fp8_filter=all"),  # the auto filter skips every linear this narrow
        (["--precision.fp8_filter=all", "--model.n_embd=40", "--model.n_head=2"], "multiples of 16"),
    ],
)
def test_fp8_that_converts_no_linear_is_refused_with_the_remedy(flags, hint):
    """fp8 asked and not given: before, nothing was converted and nothing said (the demo's model included)."""
    with pytest.raises(LoomError, match="converts none of this model's") as e:
        _par("--precision.fp8=tensorwise", *flags)
    assert hint in e.value.hint


def test_fp8_says_how_many_linears_it_converted(capsys):
    _par("--precision.fp8=tensorwise", "--precision.fp8_filter=all")
    assert "fp8: 12 of 13 linear layers in float8" in capsys.readouterr().out


def test_conversion_keeps_checkpoint_names_and_plain_tensors():
    _, plain = _par()
    _, par = _par("--precision.fp8=tensorwise", "--precision.fp8_filter=all")
    from torchao.float8.float8_linear import Float8Linear

    converted = [n for n, m in par.model.named_modules() if isinstance(m, Float8Linear)]
    assert converted == par.fp8 and len(converted) == 12  # q k v o up down, 2 blocks; not the head
    sd = par.model_state()
    assert list(sd) == list(plain.model_state())
    assert all(type(v) is torch.Tensor for v in sd.values())  # no float8 subclass reaches a checkpoint
    for k, v in plain.model_state().items():
        assert torch.equal(sd[k], v), k  # same init: fp8 changes the compute, not the weights


def test_eval_runs_in_high_precision():
    """Within high_precision the fp8 model's logits are the plain model's, bit for bit (validation, sampling);
    outside, the float8 matmuls give other values."""
    _, plain = _par()
    _, par = _par("--precision.fp8=tensorwise", "--precision.fp8_filter=all")
    x = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = plain.model(x)
        with par.high_precision():
            got = par.model(x)
        fp8_logits = par.model(x)
    assert torch.equal(got, want)
    assert not torch.allclose(fp8_logits, want, atol=1e-4)
    assert torch.isfinite(fp8_logits[..., :60]).all()


def test_fp8_head_keeps_the_padding_mask():
    _, par = _par(
        "--model.family=llama",
        "--precision.fp8=tensorwise",
        "--precision.fp8_filter=all",
        "--precision.fp8_head=true",
    )
    assert "lm_head" in par.fp8
    x = torch.randint(0, 60, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for ctx in (torch.enable_grad(), par.high_precision()):
            with ctx:
                logits = par.model(x)
            assert (logits[..., 60:] == torch.finfo(logits.dtype).min).all()  # padded ids never sampled
            assert torch.isfinite(logits[..., :60]).all()


ROWWISE_ON_CPU = pytest.param(
    "rowwise",
    marks=pytest.mark.skipif(
        fp8._torch_version() < (2, 13), reason="torch < 2.13 has no per-row float8 matmul on a CPU"
    ),
)


@pytest.mark.parametrize("recipe", ["tensorwise", ROWWISE_ON_CPU])
def test_fp8_training_steps_learn(recipe):
    cfg, par = _par(f"--precision.fp8={recipe}", "--precision.fp8_filter=all")
    opt = par.build_optimizer(cfg.optim)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 60, (4, 16), generator=g)
    losses = []
    for _ in range(8):
        loss = par.model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--precision.dtype=fp16"], "precision.dtype=fp16"),
        (["--precision.fp8_head=true"], "model.tie_embeddings=true"),
        (["--precision.fp8=e5m2"], "precision.fp8"),
    ],
)
def test_bad_fp8_configs_refused_before_any_model(flags, message):
    with pytest.raises(LoomError, match=message):
        validate(load_config(None, [*SMALL, "--precision.fp8=tensorwise", *flags]))


def test_torchao_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    cfg = load_config(None, [*SMALL, "--precision.fp8=tensorwise"])
    with pytest.raises(LoomError) as e:
        validate(cfg)
    assert "torchao" in str(e.value) and "loom[fp8]" in e.value.hint


def test_gpu_without_float8_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(LoomError, match="no float8 tensor cores"):
        fp8.check_device("tensorwise", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    fp8.check_device("tensorwise", torch.device("cuda"))  # H100: fine
    fp8.check_device("off", torch.device("cuda"))


def test_rowwise_on_an_old_cpu_torch_refused(monkeypatch):
    monkeypatch.setattr(fp8, "_torch_version", lambda: (2, 11))
    with pytest.raises(LoomError, match="rowwise on a CPU needs torch 2.13"):
        fp8.check_device("rowwise", torch.device("cpu"))
    fp8.check_device("tensorwise", torch.device("cpu"))
