"""The built-in families, gpt2 and llama: one GPT class (model/gpt.py) whose options the two presets set
(config.FAMILIES), its parallel plan (gpt_parallel.py), FLOPs (flops.py) and HF mappings (hf.py)."""

from __future__ import annotations

from loom.config import FAMILIES, Config
from loom.model import gpt_parallel, hf
from loom.model.flops import flops_per_token
from loom.model.gpt import GPT, GPTConfig
from loom.model.registry import ModelSpec, register


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
    )


def gpt_spec(name: str, **overrides) -> ModelSpec:
    """A family on loom's GPT class: only the preset differs between gpt2 and llama."""
    base = {
        "config": gpt_config,
        "build": GPT,
        "parallel": gpt_parallel,
        "flops_per_token": flops_per_token,
        "preset": FAMILIES[name],
        "hf": hf,
        # RoPE turns q and k by their position: generation runs on past block_size with its cache, as
        # transformers' does; learned positions have block_size slots, so the context is cropped instead
        "extends_context": lambda model_cfg: model_cfg.pos == "rope",
    }
    return ModelSpec(name=name, **{**base, **overrides})


for _name in ("gpt2", "llama"):
    register(gpt_spec(_name))


def moe_config(cfg: Config, vocab_size: int):
    """MoEConfig: the GPT's options plus the model.moe_* keys (loom.model.moe)."""
    import dataclasses

    from loom.model.moe import MoEConfig

    m = cfg.model
    return MoEConfig(
        **dataclasses.asdict(gpt_config(cfg, vocab_size)),
        n_experts=m.n_experts,
        top_k=m.moe_top_k,
        moe_every=m.moe_every,
        first_dense=m.moe_first_dense,
        n_shared=m.n_shared_experts,
        expert_hidden=m.moe_ffn_hidden,
        score=m.moe_score,
        aux_loss_coef=m.moe_aux_loss_coef,
        bias_update_rate=m.moe_bias_update_rate,
        gemm=m.moe_gemm,
    )


def _moe_spec() -> ModelSpec:
    from loom.model import hf_moe, moe_parallel
    from loom.model.moe import MoEGPT

    return gpt_spec(
        "moe",
        config=moe_config,
        build=MoEGPT,
        parallel=moe_parallel,
        hf=hf_moe,
        verify_model={
            "n_experts": 4,
            "moe_top_k": 2,
            "moe_bias_update_rate": 1e-3,
            "moe_aux_loss_coef": 1e-2,
        },
    )


register(_moe_spec())
