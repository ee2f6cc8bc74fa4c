"""The llama family (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head), compared against
transformers' own LlamaForCausalLM built here with random weights: logits of the same weights agree to
float32 rounding after import and after export, and greedy generation with loom's KV cache gives
transformers' tokens. Also the config preset, the parameter count, and the bad input of issue 20."""

from __future__ import annotations

import json

import pytest
import torch

from loom.config import Config, config_from_dict, load_config, to_toml, validate
from loom.errors import LoomError
from loom.generate import generate
from loom.model import hf
from loom.model.flops import param_count
from loom.model.gpt.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install 'loom[hf]'")

TOL = 1e-5  # float32


def random_llama(tmp_path, heads=4, kv_heads=2, tie=False, bias=False, vocab=100, **extra):
    """A LlamaForCausalLM saved by transformers, with non-trivial norms and biases so a mix-up would show."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=96,
        rms_norm_eps=1e-6,
        rope_theta=500.0,
        tie_word_embeddings=tie,
        attention_bias=bias,
        mlp_bias=bias,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    d = tmp_path / "llama"
    model.save_pretrained(d)
    return model, d


@pytest.mark.parametrize("kv_heads,tie,bias", [(2, False, False), (1, True, True)])  # GQA; MQA, tied, biases
def test_import_export_logits_and_greedy_generation(tmp_path, kv_heads, tie, bias):
    theirs, d = random_llama(tmp_path, kv_heads=kv_heads, tie=tie, bias=bias)
    ours = hf.load_hf(d).eval()
    assert (ours.cfg.pos, ours.cfg.norm, ours.cfg.mlp, ours.cfg.kv_heads) == (
        "rope",
        "rmsnorm",
        "swiglu",
        kv_heads,
    )
    x = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(x).logits
        assert (ours(x)[..., :100] - ref).abs().max() <= TOL  # after import
        hf.export_hf(ours, tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert type(back).__name__ == "LlamaForCausalLM"
        assert (back(x).logits - ref).abs().max() <= TOL  # after export
    prompt = x[:1, :6]
    want = theirs.generate(prompt, max_new_tokens=50, min_new_tokens=50, do_sample=False, pad_token_id=0)
    got = generate(ours, prompt, 50, temperature=0, vocab_size=100)  # KV cache: kv heads only, rotated keys
    assert got.tolist() == want.tolist() and len(set(got[0, 6:].tolist())) > 1


def test_kv_cache_equals_full_forward_with_rope_gqa_qk_norm():
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=50,
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=24,
        pos="rope",
        norm="rmsnorm",
        mlp="swiglu",
        n_kv_head=2,
        qk_norm=True,
        tie_embeddings=False,
    )
    m = GPT(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    prompt = torch.randint(0, 50, (2, 5))
    cached = generate(m, prompt, 30, temperature=0)  # 35 > block_size: the cache is dropped and recomputed
    plain = generate(m, prompt, 30, temperature=0, use_cache=False)
    assert torch.equal(cached, plain)


def test_meta_init_equals_direct_init_untied():
    cfg = GPTConfig(
        vocab_size=50,
        n_layer=2,
        n_head=4,
        n_embd=32,
        pos="rope",
        norm="rmsnorm",
        mlp="swiglu",
        n_kv_head=2,
        qk_norm=True,
        tie_embeddings=False,
    )
    a = GPT(cfg)
    a.reset_parameters(7)
    with torch.device("meta"):
        b = GPT(cfg)
    b.to_empty(device="cpu")
    for name, p in b.named_parameters():  # loom.parallel initialises each piece by name like this
        b.init_param(name, p, 7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, a.wte.weight)  # the untied head is a tensor of its own


def test_family_preset_explicit_keys_win(tmp_path):
    cfg = load_config(None, ["--model.family=llama"])
    m = cfg.model
    assert (m.pos, m.norm, m.mlp, m.tie_embeddings, m.bias) == ("rope", "rmsnorm", "swiglu", False, False)
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nfamily = "llama"\ntie_embeddings = true\n')
    cfg = load_config(toml, ["--model.norm=layernorm"])
    assert (cfg.model.pos, cfg.model.norm, cfg.model.tie_embeddings) == ("rope", "layernorm", True)
    (tmp_path / "saved.toml").write_text(to_toml(cfg))  # the run's resolved config reads back the same
    assert config_from_dict(__import__("tomllib").loads(to_toml(cfg))) == cfg
    assert load_config(None, []).model.pos == "learned"  # GPT-2 stays the default


def test_param_count_matches_the_model():
    for kw in (
        {},
        {"n_kv_head": 2},
        {"qk_norm": True, "bias": True, "tie_embeddings": True},
        {"ffn_hidden": 80},
    ):
        cfg = GPTConfig(
            vocab_size=100,
            n_layer=2,
            n_head=4,
            n_embd=48,
            pos="rope",
            norm="rmsnorm",
            mlp="swiglu",
            **{"tie_embeddings": False, **kw},
        )
        with torch.device("meta"):
            assert GPT(cfg).num_params() == param_count(cfg)
    assert GPTConfig(vocab_size=1, n_embd=192, mlp="swiglu").ffn_width == 512  # 8/3 x 192, multiple of 64


# ------------------------------------------------------------------------------------------ bad input


def test_heads_not_divisible_and_tp_not_dividing_kv_heads():
    with pytest.raises(LoomError, match="n_head=4 is not divisible by model.n_kv_head=3"):
        validate(load_config(None, ["--model.n_kv_head=3"]))
    cfg = load_config(None, ["--model.n_head=4", "--model.n_kv_head=1", "--parallel.tp=2"])
    with pytest.raises(LoomError, match="tp=2 does not divide model.n_kv_head=1"):
        validate(cfg, world=2)


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    _, d = random_llama(tmp_path)
    _edit_config(d, model_type="mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(LoomError, match="MistralForCausalLM .model_type 'mistral'.") as e:
        hf.load_hf(d)
    assert "GPT2LMHeadModel" in e.value.hint and "LlamaForCausalLM" in e.value.hint


@pytest.mark.parametrize(
    "key,value",
    [
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 500.0, "factor": 8.0}),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}),
    ],
)
def test_rope_scaling_loom_does_not_implement_is_refused(tmp_path, key, value):
    _, d = random_llama(tmp_path)
    _edit_config(d, **{key: value})
    cfg = Config()
    cfg.model.init_from = f"hf:{d}"
    with pytest.raises(
        LoomError, match=f"rope type '{value.get('rope_type', value.get('type'))}' is not implemented"
    ):
        hf.apply_init_from(cfg)


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models

    _, d = random_llama(tmp_path, vocab=100)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(120)}, unk_token="w0")).save(
        str(d / "tokenizer.json")
    )
    with pytest.raises(LoomError, match="has 120 tokens but the model's vocab_size is 100"):
        hf.load_hf(d)


def test_init_from_sets_the_llama_options_and_refuses_conflicts(tmp_path):
    _, d = random_llama(tmp_path, kv_heads=2)
    cfg = Config()
    cfg.model.init_from = f"hf:{d}"
    hf.apply_init_from(cfg, set())
    m = cfg.model
    assert (m.family, m.pos, m.n_kv_head, m.ffn_hidden, m.rope_theta, m.norm_eps) == (
        "llama",
        "rope",
        2,
        96,
        500.0,
        1e-6,
    )
    cfg = Config()
    cfg.model.init_from, cfg.model.n_kv_head = f"hf:{d}", 4
    with pytest.raises(LoomError, match="model.n_kv_head=4 conflicts with model.init_from"):
        hf.apply_init_from(cfg, {"model.n_kv_head"})


def test_export_refuses_what_llama_cannot_represent(tmp_path):
    m = GPT(
        GPTConfig(
            vocab_size=50,
            n_layer=1,
            n_head=2,
            n_embd=16,
            pos="learned",
            norm="rmsnorm",
            mlp="swiglu",
        )
    )
    with pytest.raises(LoomError, match="LlamaForCausalLM cannot represent this model: model.pos='learned'"):
        hf.export_hf(m, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


@pytest.mark.parametrize(
    "name,released",
    [("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)],
)
def test_planner_llama_presets_have_the_released_counts(name, released):
    """Meta's counts (also torchtitan's); the planner's arithmetic equals GPT.num_params() of that config."""
    from loom.plan.shapes import PRESETS

    s = PRESETS[name]
    assert s.param_count() == released
    cfg = GPTConfig(
        s.vocab_size,
        s.n_layer,
        s.n_head,
        s.n_embd,
        s.block_size,
        pos=s.pos,
        norm=s.norm,
        mlp=s.mlp,
        ffn_hidden=s.ffn_hidden,
        n_kv_head=s.n_kv_head,
        tie_embeddings=False,
    )
    assert param_count(cfg) == released


def test_data_for_an_imported_model_must_use_its_tokenizer(tmp_path):
    """model.init_from: the data's ids must fit the model and mean what the model's tokenizer.json says."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models

    _, d = random_llama(tmp_path, vocab=100)

    def words(n, offset=0):
        return Tokenizer(models.WordLevel({f"w{i}": (i + offset) % n for i in range(n)}, unk_token="w0"))

    words(90).save(str(d / "tokenizer.json"))
    spec = f"hf:{d}"
    hf.check_data_tokenizer(spec, tmp_path, 90, SimpleNamespace(tok=words(90)), 100)  # the model's own: fine
    with pytest.raises(LoomError, match="vocabulary of 120 tokens but the model imported from .* has 100"):
        hf.check_data_tokenizer(spec, tmp_path, 120, SimpleNamespace(tok=words(120)), 100)
    with pytest.raises(
        LoomError, match="separates documents with .* .id 100."
    ) as e:  # loom's added separator
        hf.check_data_tokenizer(spec, tmp_path, 101, SimpleNamespace(tok=words(101), eot_id=100), 100)
    assert "resize_token_embeddings(101)" in e.value.hint
    with pytest.raises(LoomError, match="another tokenizer than .*tokenizer.json' .90 of its 90 tokens") as e:
        hf.check_data_tokenizer(spec, tmp_path, 90, SimpleNamespace(tok=words(90, offset=1)), 100)
    assert "--tokenizer" in e.value.hint


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_loss_and_gradients(mode):
    from loom.model.gpt.gpt_parallel import blocks
    from loom.parallel.ac import apply_ac

    cfg = GPTConfig(
        vocab_size=50,
        n_layer=2,
        n_head=4,
        n_embd=32,
        block_size=16,
        pos="rope",
        norm="rmsnorm",
        mlp="swiglu",
        n_kv_head=2,
        qk_norm=True,
        tie_embeddings=False,
    )
    torch.manual_seed(0)
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    apply_ac(blocks(b), mode)
    x = torch.randint(0, 50, (2, 16))
    la, lb = a(x, x), b(x, x)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert all(
        torch.allclose(p.grad, q.grad, atol=1e-7) for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def test_an_imported_tensor_missing_or_of_another_shape_is_named():
    from loom.model.gpt.hf_llama import imported

    sd = {"a": torch.zeros(2, 3)}
    assert imported(sd, "a", (2, 3), "LlamaForCausalLM") is sd["a"]
    with pytest.raises(LoomError, match="no 'b'") as e:
        imported(sd, "b", (2, 3), "LlamaForCausalLM")
    assert "LlamaForCausalLM checkpoint" in e.value.hint
    with pytest.raises(LoomError, match=r"'a' has shape \(2, 3\), config.json implies \(3, 2\)"):
        imported(sd, "a", (3, 2), "GPT2LMHeadModel")


@pytest.mark.parametrize("eos", ["<|end_of_text|>", "</s>", "<|endoftext|>", None])
def test_a_tokenizers_own_end_of_text_separates_documents(tmp_path, eos):
    # Llama 3 (<|end_of_text|>), Llama 2 / Mistral (</s>), GPT-2: data prepared with their tokenizer.json keeps
    # the model's vocabulary; only a tokenizer without any end-of-text token gets GPT-2's added (one id more).
    from tokenizers import AddedToken, Tokenizer, models

    from loom.data.tokenizers import HFTokenizer
    from loom.model.hf import write_tokenizer

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)}, unk_token="w0"))
    if eos:
        tok.add_special_tokens([AddedToken(eos, special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert ours.eot == (eos or "<|endoftext|>") and ours.eot_id == 50
    assert ours.vocab_size == 51  # the token the file had, or the one added when it had none
    assert ours.tok.id_to_token(ours.eot_id) == ours.eot
    write_tokenizer(ours, tmp_path, block_size=16)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["bos_token"] == ours.eot


def test_an_explicit_family_of_the_other_kind_conflicts_with_the_import(tmp_path):
    """--model.family=gpt2 beside an imported Llama was overridden without a word (the run's config.toml then
    said gpt2 while it trained a llama, or the other way)."""
    _, d = random_llama(tmp_path)
    cfg = Config()
    cfg.model.init_from, cfg.model.family = f"hf:{d}", "gpt2"
    with pytest.raises(LoomError, match="model.family='gpt2' conflicts with model.init_from") as e:
        hf.apply_init_from(cfg, {"model.family"})
    assert "drop --model.family" in e.value.hint
    cfg.model.family = "llama"  # the import's own family, named: fine
    hf.apply_init_from(cfg, {"model.family"})
    assert cfg.model.family == "llama"


def test_the_dry_run_builds_the_imported_model(tmp_path, capsys):
    """`loom train --dry-run --model.init_from=hf:DIR` measured the default 4-layer gpt2, not the import."""
    from loom.cli import main

    _, d = random_llama(tmp_path)
    args = ["train", "--dry-run", "--world", "2", f"--model.init_from=hf:{d}", "--model.block_size=64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"model     llama n_layer=2 n_embd=64 n_head=4 n_kv_head=2 block_size=64 from hf:{d}" in out
