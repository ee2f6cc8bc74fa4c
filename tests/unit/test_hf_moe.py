"""The moe family against transformers' own Qwen3MoeForCausalLM built here with random weights: logits of the
same weights agree to float32 rounding after export (loaded by AutoModelForCausalLM.from_pretrained), after
import (save_pretrained's per-expert hub layout and transformers' fused in-memory layout), and after a short
`loom train --model.init_from=hf:DIR` and `loom export --format hf` of the trained run. Also the refusals of
what Qwen3-MoE cannot represent, each one LoomError naming the key."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from loom.cli import main
from loom.config import Config
from loom.errors import LoomError
from loom.metrics import read_jsonl
from loom.model import hf
from loom.model.moe import hf_moe
from loom.model.moe.moe import MoEConfig, MoEGPT
from loom.model.registry import spec_of
from loom.runs import load_run

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'loom[hf]'")

TOL = 1e-5  # float32: both sides compute the same ops in a different grouping
VOCAB = 128  # a multiple of 64: loom pads nothing, so the training loss compares with transformers' directly


def random_qwen3_moe(tmp_path, n_layer=3, mlp_only_layers=(0,), top_k=2, tie=False, **extra):
    """A Qwen3MoeForCausalLM saved by transformers, with non-trivial norms and router weights (transformers
    may start the router at zero, which would route by index)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=top_k,
        norm_topk_prob=top_k > 1,
        mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=tie,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    d = tmp_path / "qwen3_moe"
    model.save_pretrained(d)
    return model, d


def loom_moe(top_k=2, first_dense=1, moe_every=1, n_layer=3, tie=False, **extra) -> MoEGPT:
    """A loom MoE model of Qwen3-MoE's options, seeded, with non-trivial norms and routers."""
    shape = dict(
        vocab_size=100,
        n_layer=n_layer,
        n_head=4,
        n_embd=64,
        block_size=64,
        pos="rope",
        rope_theta=500.0,
        norm="rmsnorm",
        norm_eps=1e-6,
        mlp="swiglu",
        ffn_hidden=96,
        n_kv_head=2,
        qk_norm=True,
        tie_embeddings=tie,
        n_experts=4,
        top_k=top_k,
        moe_every=moe_every,
        first_dense=first_dense,
        expert_hidden=32,
    )
    torch.manual_seed(0)
    cfg = MoEConfig(**{**shape, **extra})
    model = MoEGPT(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
    return model


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "top_k,first_dense,moe_every,n_layer,tie",
    [(2, 1, 1, 3, False), (1, 0, 2, 4, True)],  # one dense first; top-1 every 2nd, tied head
)
def test_export_loads_in_transformers_with_equal_logits(
    tmp_path, top_k, first_dense, moe_every, n_layer, tie
):
    ours = loom_moe(top_k, first_dense, moe_every, n_layer, tie)
    hf_moe.export_hf(ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["mlp_only_layers"] == [i for i in range(n_layer) if not ours.cfg.is_moe(i)]
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert (
            f"model.layers.{ours.cfg.moe_layers[0]}.mlp.experts.3.down_proj.weight" in f.keys()
        )  # hub layout
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    moe = [i for i, layer in enumerate(theirs.model.layers) if hasattr(layer.mlp, "experts")]
    assert moe == ours.cfg.moe_layers
    x = batch(100)
    with torch.no_grad():
        diff = (theirs(x).logits - ours(x)[..., :100]).abs().max().item()
    assert diff <= TOL


def test_import_both_layouts_train_and_export_back(tmp_path, char_data):
    """init_from's path (apply_init_from, the family's build and load_hf_into) gives transformers' logits from
    the hub layout and the fused one; a `loom train` from it starts at transformers' loss, and the trained run
    exported with `loom export --format hf` loads in transformers with loom's logits."""
    from loom.data.loader import ShardLoader

    theirs, d = random_qwen3_moe(tmp_path)
    cfg = Config()
    cfg.model.init_from = f"hf:{d}"
    hf.apply_init_from(cfg, set())
    m = cfg.model
    assert (m.family, m.n_experts, m.moe_top_k, m.moe_first_dense, m.moe_every, m.moe_ffn_hidden) == (
        "moe",
        4,
        2,
        1,
        1,
        32,
    )
    assert (m.qk_norm, m.n_kv_head, m.ffn_hidden, m.rope_theta, m.norm_eps) == (True, 2, 96, 500.0, 1e-6)
    spec = spec_of(cfg)
    x = batch(VOCAB)
    with torch.no_grad():
        ref = theirs(x).logits
    fused = tmp_path / "fused"  # transformers' in-memory layout, as another tool might save it
    fused.mkdir()
    (fused / "config.json").write_text((d / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(fused / "model.safetensors"))
    for directory in (d, fused):
        ours = spec.build_model(cfg, VOCAB, "cpu").eval()
        spec.hf.load_hf_into(ours, spec.hf.parse_init_from(f"hf:{directory}"))
        with torch.no_grad():
            assert (ours(x) - ref).abs().max().item() <= TOL

    args = [
        "train",
        f"--data.path={char_data}",
        f"--run.dir={tmp_path}",
        "--run.name=ft",
        "--train.steps=3",
        f"--model.init_from=hf:{d}",
        "--model.block_size=32",
        "--train.batch_size=4",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.eval_every=0",
        "--optim.warmup_steps=1",
        "--train.log_every=1",
        "--train.device=cpu",
        "--precision.dtype=fp32",  # compared with transformers' fp32 loss (auto is bf16 on a bf16 CPU)
    ]
    assert main(args) == 0
    run_cfg, trained, _, _, _ = load_run(tmp_path / "ft", torch.device("cpu"))
    assert (run_cfg.model.family, run_cfg.model.n_experts) == ("moe", 4)
    first = next(r for r in read_jsonl(tmp_path / "ft" / "metrics.jsonl") if "loss" in r)
    xb, yb = ShardLoader(char_data, 4, 32, seed=run_cfg.run.seed).next_batch()
    with torch.no_grad():
        want = F.cross_entropy(theirs(xb).logits.flatten(0, 1), yb.flatten()).item()
    assert first["loss"] == pytest.approx(want, abs=1e-5)

    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ft"), "--format", "hf", "--out", str(out)]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert not torch.allclose(back(x).logits, ref)  # the trained weights, not the imported ones
        assert (back(x).logits - trained(x)).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "change,match",
    [
        ({"n_shared": 1}, "model.n_shared_experts=1 has no equivalent"),
        ({"score": "sigmoid"}, "model.moe_score='sigmoid'"),
        ({"qk_norm": False}, "model.qk_norm=False is not Qwen3-MoE's"),
    ],
)
def test_export_refuses_what_qwen3_moe_cannot_represent(tmp_path, change, match):
    model = loom_moe(**change)
    with pytest.raises(LoomError, match=match) as e:
        hf_moe.export_hf(model, tmp_path / "out")
    assert "--format safetensors" in e.value.hint
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_export_refuses_a_trained_routing_bias(tmp_path):
    model = loom_moe()
    hf_moe.export_hf(model, tmp_path / "zero")  # an all-zero bias routes as Qwen3-MoE does
    model.blocks[1].mlp.expert_bias[0] = 1e-3
    with pytest.raises(LoomError, match="routing bias .*moe_bias_update_rate.* is nonzero"):
        hf_moe.export_hf(model, tmp_path / "out")


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"head_dim": 32}, "head_dim=32 cannot be imported"),
        ({"attention_bias": True}, "attention_bias=True cannot be imported"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False cannot be imported"),
        ({"use_sliding_window": True}, "use_sliding_window=True cannot be imported"),
        ({"mlp_only_layers": [2]}, r"make layers \[0, 1\] sparse, which loom cannot express"),
        ({"mlp_only_layers": [0, 1, 2]}, "no layer is sparse"),
    ],
)
def test_import_refuses_configs_loom_cannot_represent(tmp_path, changes, match):
    _, d = random_qwen3_moe(tmp_path)
    _edit_config(d, **changes)
    cfg = Config()
    cfg.model.init_from = f"hf:{d}"
    with pytest.raises(LoomError, match=match):
        hf.apply_init_from(cfg, set())


def test_sparse_layouts_map_to_loom_and_an_explicit_other_family_is_refused(tmp_path):
    base = {"num_hidden_layers": 6, "num_experts": 4}
    layout = {
        (): (0, 1),  # every layer
        (0, 1): (2, 1),  # DeepSeek-style dense first layers
        (0, 2, 4): (1, 2),
        (0, 1, 2, 3, 4): (5, 1),  # the last layer only
    }
    for dense, want in layout.items():
        assert hf_moe._loom_layout({**base, "mlp_only_layers": list(dense)}, "x") == want
    assert hf_moe._loom_layout({**base, "decoder_sparse_step": 2}, "x") == (1, 2)  # Qwen's own every-2nd
    _, d = random_qwen3_moe(tmp_path)
    cfg = Config()
    cfg.model.init_from, cfg.model.family = f"hf:{d}", "llama"
    with pytest.raises(LoomError, match="model.family='llama' conflicts with model.init_from"):
        hf.apply_init_from(cfg, {"model.family"})
