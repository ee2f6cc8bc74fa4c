"""model.mup: each parameter kind's init std, AdamW learning rate and forward multipliers equal the table of
loom.model.mup (Tensor Programs V, Table 3, in the practitioner's guide's form), written out here; μP at the
base width is the standard model bit for bit; Muon's matrices keep their rate; a family that declares no widths
and a missing base width are refused before any work."""

from __future__ import annotations

import math

import pytest
import torch
from loomrun import TINY, loom_here

from loom.cli import main
from loom.config import Config, OptimConfig
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.model.mup import param_kind
from loom.optim.build import build_optimizer

# m = 128 / 32 = 4: hidden std 0.02 / 2, AdamW lr / 4, logits / 4; D = 64, D_base = 16: q * sqrt(16 / 64)
TABLE = {
    "wte.weight": ("embedding", 0.02, 1.0),
    "wpe.weight": ("embedding", 0.02, 1.0),
    "blocks.0.attn.q_proj.weight": ("hidden", 0.02 / 2, 1 / 4),
    "blocks.0.attn.k_proj.weight": ("hidden", 0.02 / 2, 1 / 4),
    "blocks.0.attn.v_proj.weight": ("hidden", 0.02 / 2, 1 / 4),
    "blocks.0.attn.o_proj.weight": ("hidden", 0.02 / math.sqrt(2 * 2) / 2, 1 / 4),
    "blocks.0.mlp.up_proj.weight": ("hidden", 0.02 / 2, 1 / 4),
    "blocks.0.mlp.down_proj.weight": ("hidden", 0.02 / math.sqrt(2 * 2) / 2, 1 / 4),
    "lm_head.weight": ("output", 0.02, 1.0),
    "blocks.0.ln_1.weight": ("vector", None, 1.0),
    "blocks.0.attn.q_proj.bias": ("vector", None, 1.0),
}


def _model(width: int, base: int, tie: bool = True) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=96, n_layer=2, n_head=2, n_embd=width, block_size=16, bias=True, tie_embeddings=tie
    )
    cfg.mup_base_width = base
    return GPT(cfg)


def _lr_mults(opt) -> dict[int, float]:
    return {id(p): g.get("lr_mult", 1.0) for g in opt.param_groups for p in g["params"]}


def test_multipliers_equal_the_table_for_each_parameter_kind():
    model = _model(128, 32, tie=False)
    mults = _lr_mults(build_optimizer(model, OptimConfig(), torch.device("cpu")))
    params = dict(model.named_parameters())
    for name, (kind, std, lr) in TABLE.items():
        p = params[name]
        assert param_kind(name, p) == kind, name
        assert mults[id(p)] == pytest.approx(lr), name
        if std is not None:
            module = model.get_submodule(name.rpartition(".")[0])
            assert model.init_std(name, module) == pytest.approx(std), name
            assert p.std().item() == pytest.approx(std, rel=0.1), name  # the weights drawn with it
    assert model.lm_head.mult == pytest.approx(1 / 4)
    assert model.blocks[0].attn.q_mult == pytest.approx(math.sqrt(16 / 64))
    # the forward: logits are the head's of x / m
    x = torch.randn(3, 128)
    want = torch.nn.functional.linear(x / 4, model.lm_head.weight)[:, :96]
    torch.testing.assert_close(model.lm_head(x)[:, :96], want)


def test_mup_at_the_base_width_is_the_standard_model():
    sp, mup = _model(64, 0), _model(64, 64)
    assert all(torch.equal(a, b) for a, b in zip(sp.parameters(), mup.parameters(), strict=True))
    idx = torch.randint(0, 96, (2, 16))
    assert torch.equal(sp(idx, idx), mup(idx, idx))
    assert {
        g.get("lr_mult", 1.0) for g in build_optimizer(mup, OptimConfig(), torch.device("cpu")).param_groups
    } == {1.0}


def test_muon_keeps_its_rate_and_adamw_follows_the_table():
    model = _model(128, 32)
    opt = build_optimizer(model, OptimConfig(name="muon"), torch.device("cpu"))
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert len(muon) == 1 and "lr_mult" not in muon[0]
    mults = _lr_mults(opt)
    assert mults[id(model.wte.weight)] == 1.0 and mults[id(model.blocks[0].ln_1.weight)] == 1.0


def test_mup_trains_end_to_end(tmp_path, char_data, capsys):
    loom_here(
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=m",
        *TINY,
        "--train.steps=2",
        "--model.n_embd=64",
        "--model.mup=true",
        "--model.mup_base_width=32",
    )
    assert (tmp_path / "m" / "ckpt" / "step_000002").is_dir()
    # transformers' models lack μP's multipliers: the hf export is refused, naming why
    assert main(["export", str(tmp_path / "m"), "--format", "hf", "--out", str(tmp_path / "hf")]) != 0
    assert "no μP output and attention multipliers" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model.family=moe", "--model.mup=true", "--model.mup_base_width=32"], "does not declare"),
        (["--model.mup=true"], "model.mup needs model.mup_base_width"),
    ],
)
def test_mup_refused_before_any_work(tmp_path, char_data, capsys, args, message):
    code = main(["train", f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=x", *TINY, *args])
    assert code != 0 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_config_default_is_off():
    assert Config().model.mup is False and Config().model.mup_base_width == 0
