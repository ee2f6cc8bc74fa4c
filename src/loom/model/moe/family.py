"""The moe family: loom's GPT with routed SwiGLU experts (moe.py), Llama's block otherwise. What the layers
above ask of it goes through its ModelSpec: expert parallelism and the balance step (moe_parallel.py), the
active-parameter count, the planner's expert terms, why the dry run cannot step it, its transformers mapping
(hf_moe.py) and loom verify's tiny model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loom import device
from loom.config import Config, family_key
from loom.env import native_bf16_cpu
from loom.errors import LoomError
from loom.model.gpt.family import PRESETS, gpt_config, gpt_spec
from loom.model.moe import hf_moe, moe_parallel
from loom.model.moe.moe import MoEConfig, MoEGPT
from loom.model.registry import register

# why a mixture of experts cannot be dry-run (the dry run's refusal, and loom plan --check's)
NO_DRY_RUN = (
    "the dry run's tensors hold no values, and a mixture of experts' routing decides the experts' shapes from "
    "them (how many tokens each expert takes: loom.model.moe.moe's bincount)"
)


@dataclass
class MoEKeys:
    """The moe family's config section: accepted as model.<key> when model.family=moe (--help-config lists
    them under the family), saved in config.toml beside the model keys every family has."""

    # 0 below the preset's 8: the value runs saved before the families owned their keys recorded for gpt2
    # and llama (their config.toml has every key), which a config of those families still reads
    n_experts: int = family_key(
        0,
        "Routed SwiGLU experts per MoE layer (the family's preset: 8).",
        ge=1,
        msg="model.family=moe needs model.n_experts >= 1",
        hint="e.g. model.n_experts=8",
    )
    moe_top_k: int = family_key(2, "Experts each token is routed to (at most n_experts).", ge=1)
    moe_every: int = family_key(1, "Every k-th layer after the first dense ones is a MoE layer.", ge=1)
    moe_first_dense: int = family_key(0, "The first layers keep a dense MLP (DeepSeek-V3: 3).", ge=0)
    n_shared_experts: int = family_key(0, "Shared experts every token passes through (DeepSeek: 1).", ge=0)
    moe_ffn_hidden: int = family_key(
        0, "An expert's hidden width; 0: the dense MLP's (ffn_hidden's rule).", ge=0
    )
    moe_score: str = family_key(
        "softmax",
        "Router scores: softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3).",
        choices=("softmax", "sigmoid"),
    )
    moe_aux_loss_coef: float = family_key(
        0.0,
        "Weight of the sequence-wise load-balancing loss (Switch/GShard form; ~1e-3 to 1e-2); 0: none.",
        ge=0,
    )
    moe_bias_update_rate: float = family_key(
        0.0,
        "DeepSeek-V3's auxiliary-loss-free balancing: each step every expert's routing bias moves by this "
        "towards the mean load (~1e-3); 0: none.",
        ge=0,
    )
    moe_gemm: str = family_key(
        "auto",
        "The experts' matmuls: auto (one grouped GEMM where torch._grouped_mm runs, else a loop) | grouped | "
        "loop.",
        choices=("auto", "grouped", "loop"),
    )


def check(cfg: Config) -> None:
    """The moe family's rules (config.validate runs them after every key's bounds): k of E, a MoE layer, the
    grouped GEMM's dtype, what the balance loss composes with, and ep dividing the experts."""
    m, p = cfg.model, cfg.parallel
    if m.moe_top_k > m.n_experts:
        raise LoomError(
            f"model.moe_top_k={m.moe_top_k} is more than model.n_experts={m.n_experts}",
            hint=f"route each token to at most {m.n_experts} experts",
        )
    if m.moe_first_dense >= m.n_layer:
        raise LoomError(
            f"model.moe_first_dense={m.moe_first_dense} leaves no MoE layer among {m.n_layer}",
            hint=f"use moe_first_dense < {m.n_layer}",
        )
    dtype = cfg.precision.dtype
    on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and device.default_type() == "cpu")
    if dtype == "auto" and on_cpu and not native_bf16_cpu():  # auto: fp32 on a CPU without bf16 units
        dtype = "fp32"
    if m.moe_gemm == "grouped" and cfg.train.compile and dtype in ("fp32", "fp16"):
        raise LoomError(
            f"model.moe_gemm=grouped with train.compile in {dtype}: the grouped GEMM compiles in "
            "bf16 only (its meta function refuses other types)",
            hint="use model.moe_gemm=auto (the loop where grouped cannot run), or precision.dtype=bf16",
        )
    if m.moe_aux_loss_coef and p.pp > 1:
        raise LoomError(
            "model.moe_aux_loss_coef > 0 is not supported with pipeline parallel (the balance loss of earlier "
            "stages cannot join the last stage's loss)",
            hint="balance with model.moe_bias_update_rate (DeepSeek-V3's auxiliary-loss-free way) instead",
        )
    if m.moe_aux_loss_coef and p.cp > 1:
        raise LoomError(
            "model.moe_aux_loss_coef > 0 is not supported with context parallel (the loss is per sequence, and "
            "each cp rank holds a part of each)",
            hint="balance with model.moe_bias_update_rate instead",
        )
    if p.ep > 1 and m.n_experts % p.ep:
        divisors = ", ".join(str(d) for d in range(1, m.n_experts + 1) if m.n_experts % d == 0)
        raise LoomError(
            f"parallel.ep={p.ep} does not divide model.n_experts={m.n_experts} (each rank holds whole experts)",
            hint="pick ep among the divisors of n_experts: " + divisors,
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


# model.moe_* key -> the planner's field for it (loom.plan.shapes.ModelShape), read both ways: the planner names
# its fields as MoEConfig does (hf_moe.MOE_KEYS), and has no router score
SHAPE_FIELDS = {key: field for key, field in hf_moe.MOE_KEYS.items() if key != "moe_score"}


def plan_shape(m) -> dict:
    """The planner's expert terms (loom.plan.shapes.ModelShape) from the model.moe_* keys."""
    return {field: getattr(m, key) for key, field in SHAPE_FIELDS.items()}


def shape_keys(shape) -> dict:
    """The model.moe_* keys of a planner shape (loom plan --check dry-runs it with them)."""
    return {key: getattr(shape, field) for key, field in SHAPE_FIELDS.items()}


SPEC = register(
    gpt_spec(
        "moe",
        config=moe_config,
        build=MoEGPT,
        preset={**PRESETS["llama"], "n_experts": 8},  # Llama's block with 8 routed experts
        keys=MoEKeys,
        check=check,
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
