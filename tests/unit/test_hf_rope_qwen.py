"""Today's dense bases through model.init_from=hf:DIR and `loom export`: a Llama 3.1-style config (rope_type
llama3), Qwen3 (QK-norm) and Qwen2.5 (q/k/v biases), each a tiny random model that transformers builds here.
Compared against transformers itself: fp32 logits after import and after export (the export loaded back by
AutoModelForCausalLM), greedy generation past llama3's original context, and the refusal of a rope type loom
does not compute."""

from __future__ import annotations

import json

import pytest
import torch

from loom.config import Config, load_config, validate
from loom.errors import LoomError
from loom.generate import generate
from loom.model import hf
from loom.model.flops import param_count
from loom.model.gpt.gpt import GPT, GPTConfig, Rope, rope_inv_freq

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'loom[hf]'")

TOL = 1e-5  # float32
V = 100
# llama3 scaling with an original context of 32 tokens: generation below runs to 56, and with head size 16 and
# theta 500 the wavelengths (6 to 1,444 tokens) fall in all three bands: kept below 8, divided above 32
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
# YaRN on the same original context, its attention factor left to the reader (0.1 ln 4 + 1)
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 32}


def random_model(tmp_path, kind: str, tie: bool = False):
    """A tiny transformers model of `kind` (llama3, qwen3, qwen2) with random weights, its norms and biases
    moved off their initial values so a mix-up would show, saved by save_pretrained."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
    )
    default = {"rope_type": "default", "rope_theta": 500.0}
    if kind in ("llama3", "yarn"):
        rope = LLAMA3 if kind == "llama3" else YARN
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=rope))
    elif kind.startswith("qwen3"):  # head_dim: 16 = hidden_size / heads; wide: 32, as Qwen3-0.6B's 128 of 64
        head_dim = 32 if kind == "qwen3_wide" else 16
        cfg = transformers.Qwen3Config(**common, head_dim=head_dim, rope_parameters=default)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_parameters=default))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    d = tmp_path / kind
    model.eval().save_pretrained(d)
    return model, d


@pytest.mark.parametrize(
    "kind,tie,cls",
    [
        ("llama3", False, "LlamaForCausalLM"),
        ("yarn", False, "LlamaForCausalLM"),
        ("qwen3", False, "Qwen3ForCausalLM"),
        ("qwen3_wide", True, "Qwen3ForCausalLM"),
        ("qwen2", True, "Qwen2ForCausalLM"),
    ],
)
def test_logits_export_and_greedy_generation_equal_transformers(tmp_path, kind, tie, cls):
    theirs, d = random_model(tmp_path, kind, tie)
    ours = hf.load_hf(d).eval()
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(x).logits
        assert (ours(x)[..., :V] - ref).abs().max() <= TOL  # after import
        hf.export_hf(ours, tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert type(back).__name__ == cls
        assert (back(x).logits - ref).abs().max() <= TOL  # after export
    # 6 + 50 tokens: past llama3's and yarn's original context of 32 (no eos id: min_new_tokens would mask its logit)
    prompt = x[:1, :6]
    want = theirs.generate(prompt, max_new_tokens=50, min_new_tokens=50, do_sample=False, pad_token_id=0)
    got = generate(ours, prompt, 50, temperature=0, vocab_size=V)
    assert got.tolist() == want.tolist() and len(set(got[0, 6:].tolist())) > 1


def test_llama3_scaling_changes_the_model_and_is_what_init_from_sets(tmp_path):
    theirs, d = random_model(tmp_path, "llama3")
    cfg = Config()
    cfg.model.init_from = f"hf:{d}"
    hf.apply_init_from(cfg, set())
    m = cfg.model
    assert (m.family, m.rope_type, m.rope_factor, m.rope_original_context) == ("llama", "llama3", 4.0, 32)
    assert (m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_theta) == (1.0, 4.0, 500.0)
    validate(cfg)
    # the same weights read with default RoPE give other logits: the scaling is really applied
    ours = hf.load_hf(d).eval()
    plain = GPT(GPTConfig(**{**ours.cfg.__dict__, "rope_type": "default"})).eval()
    plain.load_state_dict(ours.state_dict())
    x = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (plain(x)[..., :V] - theirs(x).logits).abs().max() > 1e-3
    inv = rope_inv_freq(16, Rope(500.0, "llama3", 4.0, 1.0, 4.0, 32))
    base = rope_inv_freq(16, 500.0)
    kept, divided = inv == base, torch.isclose(inv, base / 4)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands


def test_qwen_options_set_by_init_from_and_their_parameter_count(tmp_path):
    for kind, want in (("qwen3", (True, False)), ("qwen2", (False, True)), ("qwen3_wide", (True, False))):
        theirs, d = random_model(tmp_path, kind)
        cfg = Config()
        cfg.model.init_from = f"hf:{d}"
        hf.apply_init_from(cfg, set())
        assert (cfg.model.family, cfg.model.qk_norm, cfg.model.qkv_bias, cfg.model.bias) == (
            "llama",
            *want,
            False,
        )
        assert cfg.model.head_size == (32 if kind == "qwen3_wide" else 0)
        validate(cfg)
        model = hf.load_hf(d)
        padding = (model.cfg.padded_vocab - V) * 64 * 2  # loom's padded embedding and head rows
        assert (
            model.num_params()
            == param_count(model.cfg)
            == sum(p.numel() for p in theirs.parameters()) + padding
        )


def test_family_keys_from_the_command_line_and_only_for_llama():
    cfg = load_config(None, ["--model.family=llama", "--model.rope_type=llama3", "--model.rope_factor=8"])
    assert (cfg.model.rope_type, cfg.model.rope_factor) == ("llama3", 8.0)
    with pytest.raises(
        LoomError, match="rope_type must be one of default, linear, llama3, yarn; got 'dynamic'"
    ):
        validate(load_config(None, ["--model.family=llama", "--model.rope_type=dynamic"]))
    with pytest.raises(LoomError, match="model.qkv_bias is for model.family=llama"):
        load_config(None, ["--model.qkv_bias=true"])


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_an_unsupported_rope_type_is_named_with_the_supported_ones(tmp_path, kind):
    _, d = random_model(tmp_path, "llama3")
    spec = json.loads((d / "config.json").read_text())
    spec["rope_parameters"] = {"rope_type": kind, "rope_theta": 500.0, "factor": 4.0}
    (d / "config.json").write_text(json.dumps(spec))
    cfg = Config()
    cfg.model.init_from = f"hf:{d}"
    with pytest.raises(LoomError, match=f"rope type '{kind}' is not implemented in loom") as e:
        hf.apply_init_from(cfg)
    assert "supported: default, linear, llama3, yarn" in str(e.value)


def test_export_refuses_what_no_architecture_represents(tmp_path):
    shape = dict(vocab_size=50, n_layer=1, n_head=2, n_embd=16, pos="rope", norm="rmsnorm", mlp="swiglu")
    m = GPT(GPTConfig(**shape, qk_norm=True, qkv_bias=True))
    with pytest.raises(LoomError, match="Qwen3ForCausalLM cannot represent this model: model.qkv_bias=True"):
        hf.export_hf(m, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_train_from_the_import_and_export_the_run(tmp_path, char_data, kind):
    """`loom train --model.init_from=hf:DIR` then `loom export`: the first step's loss is transformers' on that
    batch (the family keys reached the model), and the exported run loads in transformers with loom's logits
    (the keys were saved with the run and written back)."""
    import torch.nn.functional as F
    from tiny import tiny_args

    from loom.cli import main
    from loom.data.loader import ShardLoader
    from loom.metrics import read_jsonl
    from loom.runs import load_run

    theirs, d = random_model(tmp_path, kind)
    tiny = tiny_args({"train.batch_size": 4, "train.eval_batches": 1, "optim.warmup_steps": 1})
    args = ["train", f"--data.path={char_data}", f"--run.dir={tmp_path}", "--run.name=ft", "--train.steps=2"]
    assert main([*args, f"--model.init_from=hf:{d}", *[a for a in tiny if "n_" not in a]]) == 0
    cfg, model, _, _, _ = load_run(tmp_path / "ft", torch.device("cpu"))
    assert (cfg.model.rope_type, cfg.model.qkv_bias) == (
        ("llama3", False) if kind == "llama3" else ("default", True)
    )
    first = next(r for r in read_jsonl(tmp_path / "ft" / "metrics.jsonl") if "loss" in r)
    x, y = ShardLoader(char_data, 4, cfg.model.block_size, seed=cfg.run.seed).next_batch()
    with torch.no_grad():
        want = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()).item()
    assert first["loss"] == pytest.approx(want, abs=1e-5)
    assert main(["export", str(tmp_path / "ft"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert (back(x).logits - model.eval()(x)[..., :V]).abs().max() <= TOL
