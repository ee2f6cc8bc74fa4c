"""The moe family: loom's GPT with routed SwiGLU experts (moe.py), Llama's block otherwise. What the layers
above ask of it goes through its ModelSpec: expert parallelism and the balance step (moe_parallel.py), the
active-parameter count, the planner's expert terms, why the dry run cannot step it, its transformers mapping
(hf_moe.py) and loom verify's tiny model."""

from __future__ import annotations

import dataclasses

from loom.config import Config
from loom.model.gpt.family import gpt_config, gpt_spec
from loom.model.moe import hf_moe, moe_parallel
from loom.model.moe.moe import MoEConfig, MoEGPT
from loom.model.registry import register

# why a mixture of experts cannot be dry-run (the dry run's refusal, and loom plan --check's)
NO_DRY_RUN = (
    "the dry run's tensors hold no values, and a mixture of experts' routing decides the experts' shapes from "
    "them (how many tokens each expert takes: loom.model.moe.moe's bincount)"
)


def moe_config(cfg: Config, vocab_size: int) -> MoEConfig:
    """MoEConfig: the GPT's options plus the model.moe_* keys."""
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


def plan_shape(m) -> dict:
    """The planner's expert terms (loom.plan.shapes.ModelShape) from the model.moe_* keys."""
    return {
        "n_experts": m.n_experts,
        "top_k": m.moe_top_k,
        "moe_every": m.moe_every,
        "first_dense": m.moe_first_dense,
        "n_shared": m.n_shared_experts,
        "expert_hidden": m.moe_ffn_hidden,
    }


def shape_keys(shape) -> dict:
    """The model.moe_* keys of a planner shape (loom plan --check dry-runs it with them)."""
    return {
        "n_experts": shape.n_experts,
        "moe_top_k": shape.top_k,
        "moe_every": shape.moe_every,
        "moe_first_dense": shape.first_dense,
        "n_shared_experts": shape.n_shared,
        "moe_ffn_hidden": shape.expert_hidden,
    }


SPEC = register(
    gpt_spec(
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
        verify_split={"moe_aux_loss_coef": 0.0},
        active_params=MoEGPT.num_active_params,
        expert_layers=moe_parallel.expert_layers,
        after_step=moe_parallel.after_step,
        plan_shape=plan_shape,
        shape_keys=shape_keys,
        no_dry_run=NO_DRY_RUN,
    )
)
