"""Model families through the registry (loom.model.registry): the built-in gpt2 and llama specs, an unknown
family's error, a family registered in-process, and generation past block_size as the family says: a RoPE
model runs on with its cache and equals transformers' LlamaForCausalLM greedy decoding token for token (it
re-cropped the context before); learned positions crop as before. Compared against: transformers, and the
cache-free loop."""

from __future__ import annotations

import pytest
import torch

from loom.config import load_config
from loom.errors import LoomError
from loom.generate import generate
from loom.model import hf, registry
from loom.model.gpt.gpt import GPT, GPTConfig


def test_built_in_families_share_one_class_with_their_presets():
    for name, pos in (("gpt2", "learned"), ("llama", "rope")):
        cfg = load_config(None, [f"--model.family={name}", "--model.n_layer=1", "--model.n_embd=32"])
        spec = registry.spec_of(cfg)
        model = spec.build_model(cfg, 70, "cpu")
        assert spec.name == name and isinstance(model, GPT) and model.cfg.pos == pos
        assert spec.extends_context(model.cfg) == (pos == "rope")
        assert spec.flops_per_token(model.cfg, None) > 0 and spec.parallel.blocks(model) == list(model.blocks)


def test_an_unknown_family_says_how_to_load_a_plugin():
    with pytest.raises(LoomError, match="LOOM_PLUGINS"):
        registry.get("mamba")
    with pytest.raises(LoomError, match="LOOM_PLUGINS"):
        load_config(None, ["--model.family=mamba"])


def test_a_registered_family_is_a_config_value_with_its_preset():
    spec = registry.get("gpt2")
    registry.register(
        registry.ModelSpec(
            name="test-rope-gpt2",
            config=spec.config,
            build=spec.build,
            parallel=spec.parallel,
            flops_per_token=spec.flops_per_token,
            preset={"pos": "rope"},
        )
    )
    try:
        cfg = load_config(None, ["--model.family=test-rope-gpt2"])
        assert cfg.model.pos == "rope" and registry.spec_of(cfg).name == "test-rope-gpt2"
    finally:
        registry._SPECS.pop("test-rope-gpt2")
        registry.FAMILIES.pop("test-rope-gpt2")


def test_a_rope_model_generates_past_block_size_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs transformers (the hf extra)")
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=70,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        block_size=16,
        pos="rope",
        norm="rmsnorm",
        mlp="swiglu",
        tie_embeddings=False,
    )
    ours = GPT(cfg).eval()
    hf.export_hf(ours, tmp_path / "llama")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    prompt = torch.randint(0, 70, (1, 5), generator=torch.Generator().manual_seed(1))
    new = 40  # 45 tokens: far past block_size 16
    want = theirs.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    spec = registry.get("llama")
    got = generate(ours, prompt, new, temperature=0, extends_context=spec.extends_context(cfg))
    assert got.tolist() == want.tolist()
    cropped = generate(ours, prompt, new, temperature=0)  # what loom did before: a different continuation
    assert cropped[:, :16].tolist() == want[:, :16].tolist() and cropped.tolist() != want.tolist()


def test_learned_positions_crop_and_the_cache_matches_the_cache_free_loop():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=70, n_layer=1, n_head=2, n_embd=32, block_size=8)
    model = GPT(cfg).eval()
    assert not registry.get("gpt2").extends_context(cfg)
    prompt = torch.randint(0, 70, (2, 3))
    with_cache = generate(model, prompt, 20, temperature=0, extends_context=False)
    without = generate(model, prompt, 20, temperature=0, use_cache=False)
    assert with_cache.tolist() == without.tolist()
