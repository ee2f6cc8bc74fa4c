"""The built-in families gpt2 and llama: one GPT class (gpt.py) whose options the two presets set (PRESETS,
registered into config.FAMILIES), its parallel plan (gpt_parallel.py), FLOPs (model/flops.py) and HF mappings
(model/hf.py, hf_llama.py). `gpt_config` and `gpt_spec` are what a family built on loom's GPT starts from (moe, plug-ins)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from loom.config import Config, family_key
from loom.model import hf
from loom.model.flops import flops_per_token
from loom.model.gpt import gpt_parallel, hf_llama
from loom.model.gpt.gpt import GPT, ROPE_TYPES, GPTConfig
from loom.model.registry import ModelSpec, register


@dataclass
class LlamaKeys:
    """The llama family's own keys (model.<key> with model.family=llama): RoPE scaling as Llama 3.1-3.3 set it,
    and Qwen 2.5's attention biases. model.init_from=hf:DIR sets them from the config.json."""

    rope_type: str = family_key(
        "default",
        "RoPE frequencies: default | linear (all divided by rope_factor) | llama3 (Llama 3.1: long wavelengths "
        "divided by rope_factor, short ones kept, blended between) | yarn (the same by rotations, cos/sin scaled).",
        choices=ROPE_TYPES,
    )
    rope_factor: float = family_key(
        1.0, "rope_type linear, llama3 or yarn: how much longer the context gets.", gt=0
    )
    rope_low_freq_factor: float = family_key(
        1.0,
        "rope_type=llama3: wavelengths above rope_original_context / this are divided by rope_factor.",
        gt=0,
    )
    rope_high_freq_factor: float = family_key(
        4.0, "rope_type=llama3: wavelengths below rope_original_context / this are kept as they are.", gt=0
    )
    rope_original_context: int = family_key(
        8192, "rope_type llama3 or yarn: the context length of pretraining, before the scaling.", ge=1
    )
    rope_beta_fast: float = family_key(
        32.0,
        "rope_type=yarn: dimensions turning more often than this in the original context are kept.",
        gt=0,
    )
    rope_beta_slow: float = family_key(
        1.0, "rope_type=yarn: dimensions turning less often than this are divided by rope_factor.", gt=0
    )
    rope_attention_factor: float = family_key(
        0.0, "rope_type=yarn: cos and sin are scaled by it; 0: YaRN's 0.1 ln(rope_factor) + 1.", ge=0
    )
    head_size: int = family_key(
        0,
        "Each attention head's width; 0: n_embd / n_head. Qwen3-0.6B and 4B set 128 (n_head x head_size is then "
        "not n_embd: q and o map between the two).",
        ge=0,
    )
    qkv_bias: bool = family_key(
        False, "Biases on the q, k and v projections only (Qwen 2 / 2.5); model.bias puts them everywhere."
    )


def llama_keys(m) -> dict:
    """The LlamaKeys of the model section m, their defaults for a family without them (gpt2, moe)."""
    return {f.name: getattr(m, f.name, f.default) for f in fields(LlamaKeys)}


def gpt_config(cfg: Config, vocab_size: int) -> GPTConfig:
    """GPTConfig from loom's model section; model.vocab_size=0 takes the data's vocabulary."""
    m = cfg.model
    return GPTConfig(
        vocab_size=m.vocab_size or vocab_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        block_size=m.block_size,
        dropout=m.dropout,
        bias=m.bias,
        activation=m.activation,
        pos=m.pos,
        rope_theta=m.rope_theta,
        norm=m.norm,
        norm_eps=m.norm_eps,
        mlp=m.mlp,
        ffn_hidden=m.ffn_hidden,
        n_kv_head=m.n_kv_head,
        qk_norm=m.qk_norm,
        tie_embeddings=m.tie_embeddings,
        doc_mask=cfg.data.doc_mask,  # its eot_id, the data's, is set by ModelSpec.build_model
        doc_positions=cfg.data.doc_positions,
        mup_base_width=m.mup_base_width if m.mup else 0,
        mtp_depth=m.mtp_depth,
        mtp_weight=m.mtp_weight,
        **llama_keys(m),
    )


def llama_plan_shape(m) -> dict:
    """The planner's terms from the llama family's keys (loom.plan.shapes.ModelShape): Qwen3's head width,
    Qwen 2.5's q/k/v biases (RoPE scaling changes no count)."""
    return {"head_size": m.head_size, "qkv_bias": m.qkv_bias}


def llama_shape_keys(shape) -> dict:
    """The model keys of a planner shape's llama terms (loom plan --check dry-runs it with them)."""
    return {"head_size": shape.head_size, "qkv_bias": str(shape.qkv_bias).lower()}


# the presets: the model keys model.family=NAME sets unless the TOML or the command line sets them (gpt2's are
# the defaults: a config of the default family parses before any family is registered)
PRESETS = {
    "gpt2": {"pos": "learned", "norm": "layernorm", "mlp": "gelu", "tie_embeddings": True},
    "llama": {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "tie_embeddings": False, "bias": False},
}


def gpt_spec(name: str, **overrides) -> ModelSpec:
    """A family on loom's GPT class: only the preset differs between gpt2 and llama."""
    base = {
        "config": gpt_config,
        "build": GPT,
        "parallel": gpt_parallel,
        "flops_per_token": flops_per_token,
        "preset": PRESETS.get(name, {}),
        "hf": hf,
        # RoPE turns q and k by their position: generation runs on past block_size with its cache, as
        # transformers' does; learned positions have block_size slots, so the context is cropped instead
        "extends_context": lambda model_cfg: model_cfg.pos == "rope",
        "position_table": lambda model: model.wpe,  # None with RoPE
        "ring_attention": True,  # CausalSelfAttention.context
    }
    return ModelSpec(name=name, **{**base, **overrides})


register(gpt_spec("gpt2", mup=True, mtp=True))
# peft: transformers' Llama names, what peft targets; keys: RoPE scaling and Qwen 2.5's q/k/v biases
register(
    gpt_spec(
        "llama",
        peft=hf_llama.peft_modules,
        keys=LlamaKeys,
        plan_shape=llama_plan_shape,
        shape_keys=llama_shape_keys,
        mup=True,
        mtp=True,
    )
)
