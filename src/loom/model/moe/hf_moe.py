"""Qwen3-MoE interoperability with Hugging Face transformers: Qwen3MoeForCausalLM directories both ways.

loom's moe family is Qwen3-MoE's architecture when its options are Qwen3's: RoPE (half-split, as Llama),
RMSNorm, SwiGLU, QK-norm, grouped-query attention, no biases, softmax routing over fp32 router logits, top-k,
the k weights renormalised (norm_topk_prob), no shared experts. The attention and dense layers map as
hf_llama.py's; the MoE layers:

  loom                                         Qwen3MoeForCausalLM (transformers)
  blocks.i.attn.{q,k}_norm.weight (D,)         model.layers.i.self_attn.{q,k}_norm.weight
  blocks.i.mlp.router.weight (E, C)            model.layers.i.mlp.gate.weight
  blocks.i.mlp.experts.gate_proj[e] (H, C)     model.layers.i.mlp.experts.e.gate_proj.weight   (hub layout)
  blocks.i.mlp.experts.up_proj[e] (H, C)       model.layers.i.mlp.experts.e.up_proj.weight
  blocks.i.mlp.experts.down_proj[e] (C, H)     model.layers.i.mlp.experts.e.down_proj.weight
  blocks.i.mlp.expert_bias (E,)                none: exported only when all zero, imported as zeros

transformers 5 holds the experts fused in memory (mlp.experts.gate_up_proj (E, 2H, C), gate rows first, and
mlp.experts.down_proj (E, C, H)), but its save_pretrained writes the per-expert hub layout above (the layout
of the released checkpoints) and from_pretrained reads both. Export writes the hub layout; import reads
either.

Which layers are MoE: Qwen3-MoE's layer i is sparse iff i is not in mlp_only_layers and (i + 1) %
decoder_sparse_step == 0; loom's iff i >= moe_first_dense and (i - moe_first_dense) % moe_every == 0.
Export writes decoder_sparse_step=1 and the dense layers as mlp_only_layers (any loom layout is expressible);
import accepts the sparse sets that are an arithmetic run to the last layer and refuses the others.

Balancing is a training option, not part of the model: export writes model.moe_aux_loss_coef as
router_aux_loss_coef (transformers applies it only with output_router_logits=true, and its loss is the
batch-wise Switch form where loom's is sequence-wise); import leaves model.moe_aux_loss_coef and
model.moe_bias_update_rate to the user. A trained DeepSeek-style routing bias (moe_bias_update_rate) shapes
the routing and Qwen3-MoE has no such term, so a nonzero one is refused on export.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from loom import log
from loom.errors import LoomError
from loom.model import hf_io
from loom.model.gpt import hf_llama
from loom.model.moe.moe import MoEConfig, MoEGPT

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
parse_init_from = hf_io.parse_init_from  # the trainer asks the family's mapping (ModelSpec.hf) for both
_EXPORT_HINT = "export it with --format safetensors (loom's own layout)"
# loom's model.* config key of each MoEConfig field that a Qwen3-MoE config.json sets
MOE_KEYS = {
    "n_experts": "n_experts",
    "moe_top_k": "top_k",
    "moe_every": "moe_every",
    "moe_first_dense": "first_dense",
    "n_shared_experts": "n_shared",
    "moe_ffn_hidden": "expert_hidden",
    "moe_score": "score",
}
# MoEConfig fields that are the run's, not the checkpoint's: taken from the model when weights are loaded
_RUN_FIELDS = (
    "block_size",
    "dropout",
    "doc_mask",
    "eot_id",
    "doc_positions",
    "aux_loss_coef",
    "bias_update_rate",
    "gemm",
)


def _refuse(field: str, why: str, hint: str = _EXPORT_HINT) -> LoomError:
    return LoomError(f"{ARCHITECTURE} cannot represent this model: {field} {why}", hint=hint)


# ------------------------------------------------------------------------------------------- export


def check_exportable(cfg: MoEConfig, expert_bias: list[torch.Tensor] = ()) -> None:
    """Refuse, naming loom's config key, a model Qwen3MoeForCausalLM has no setting for.
    `expert_bias`: the MoE layers' routing-bias buffers (a nonzero one changes which experts are chosen)."""
    want = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True, "bias": False}
    for key, value in want.items():
        if getattr(cfg, key) != value:
            raise _refuse(f"model.{key}={getattr(cfg, key)!r}", f"is not Qwen3-MoE's ({value!r})")
    if cfg.n_shared:
        raise _refuse(
            f"model.n_shared_experts={cfg.n_shared}",
            "has no equivalent: Qwen3-MoE has routed experts only (shared experts are DeepSeek's and Qwen2-MoE's)",
        )
    if cfg.score != "softmax":
        raise _refuse(f"model.moe_score={cfg.score!r}", "has no equivalent: Qwen3-MoE's router is a softmax")
    if cfg.n_embd % cfg.n_head:
        raise _refuse(f"model.n_embd={cfg.n_embd}", f"is not divisible by model.n_head={cfg.n_head}")
    for b in expert_bias:
        if b.abs().max() > 0:
            raise _refuse(
                "the routing bias (trained with model.moe_bias_update_rate > 0)",
                "is nonzero: Qwen3-MoE's top-k choice has no bias term, so transformers would route "
                "tokens to other experts",
            )


def qwen3_moe_config(cfg: MoEConfig, eot_id: int | None = None) -> dict:
    """config.json of a Qwen3MoeForCausalLM with loom's shape (vocabulary unpadded)."""
    check_exportable(cfg)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_width,  # the dense layers' MLP
        "moe_intermediate_size": cfg.expert_width,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # the second for transformers 4.x readers
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        # loom renormalises k > 1 weights only: one expert keeps its softmax probability as its weight
        "norm_topk_prob": cfg.norm_topk and cfg.top_k > 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.n_layer) if not cfg.is_moe(i)],
        "router_aux_loss_coef": cfg.aux_loss_coef,
        "output_router_logits": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
    }


def qwen3_moe_state_dict(sd: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """loom weights (fp32 on the host, by loom's names) in Qwen3-MoE's hub names, vocabulary unpadded."""
    check_exportable(cfg, [sd[f"blocks.{i}.mlp.expert_bias"] for i in cfg.moe_layers])
    V = cfg.vocab_size
    out = {"model.embed_tokens.weight": sd["wte.weight"][:V], "model.norm.weight": sd["ln_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:V]
    for i in range(cfg.n_layer):
        for ours, theirs in hf_llama.layer_names(i):
            if ours in sd:  # a MoE layer has no dense mlp.{gate,up,down}_proj
                out[theirs] = sd[ours]
        if not cfg.is_moe(i):
            continue
        p, h = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        out[h + "gate.weight"] = sd[p + "router.weight"]
        for n in ("gate", "up", "down"):
            w = sd[p + f"experts.{n}_proj"]  # (E, out, in)
            for e in range(cfg.n_experts):
                out[h + f"experts.{e}.{n}_proj.weight"] = w[e]
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(model: MoEGPT, out: str | Path, tokenizer=None, force: bool = False) -> list[str]:
    """Write a directory that `transformers.AutoModelForCausalLM.from_pretrained(out)` loads as
    Qwen3MoeForCausalLM; returns notes for the user (what could not be written)."""
    from safetensors.torch import save_file

    eot = getattr(tokenizer, "eot_id", None)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    config = qwen3_moe_config(model.cfg, eot)  # both refuse before anything is written
    state = qwen3_moe_state_dict(sd, model.cfg)
    out = Path(out)
    hf_io._prepare_out(out, force)
    (out / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eot, "eos_token_id": eot}, indent=1), encoding="utf-8"
    )
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return hf_io.write_tokenizer(tokenizer, out, model.cfg.block_size)


# ------------------------------------------------------------------------------------------- import

# Qwen3MoeConfig's defaults (transformers), for keys a config.json leaves out
_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
}


def _get(hf_cfg: dict, key: str):
    if key == "num_experts":  # transformers 5's save_pretrained writes its attribute name, num_local_experts
        return hf_cfg.get("num_experts", hf_cfg.get("num_local_experts", _DEFAULTS[key]))
    value = hf_cfg.get(key)
    return _DEFAULTS.get(key) if value is None else value


def sparse_layers(hf_cfg: dict) -> list[int]:
    """The layers Qwen3MoeDecoderLayer builds as Qwen3MoeSparseMoeBlock."""
    step, dense = _get(hf_cfg, "decoder_sparse_step"), set(hf_cfg.get("mlp_only_layers") or [])
    n = _get(hf_cfg, "num_hidden_layers")
    return [i for i in range(n) if i not in dense and _get(hf_cfg, "num_experts") > 0 and (i + 1) % step == 0]


def _loom_layout(hf_cfg: dict, path) -> tuple[int, int]:
    """(moe_first_dense, moe_every) giving Qwen3-MoE's sparse layers, or a LoomError naming the keys."""
    n, sparse = _get(hf_cfg, "num_hidden_layers"), sparse_layers(hf_cfg)
    first = sparse[0]
    every = sparse[1] - first if len(sparse) > 1 else max(1, n - first)
    if [i for i in range(n) if i >= first and (i - first) % every == 0] != sparse:
        raise LoomError(
            f"'{path}': mlp_only_layers={hf_cfg.get('mlp_only_layers')} with decoder_sparse_step="
            f"{_get(hf_cfg, 'decoder_sparse_step')} make layers {sparse} sparse, which loom cannot express",
            hint="loom's MoE layers are every model.moe_every-th from model.moe_first_dense to the last layer",
        )
    return first, every


def check_config(hf_cfg: dict, path) -> None:
    """What loom's moe family cannot represent, named with the key (before any weight is read)."""
    E, k = _get(hf_cfg, "num_experts"), _get(hf_cfg, "num_experts_per_tok")
    C, H = _get(hf_cfg, "hidden_size"), _get(hf_cfg, "num_attention_heads")
    step = _get(hf_cfg, "decoder_sparse_step")
    checks = [
        (
            "head_dim",
            hf_cfg.get("head_dim") in (None, C // H) and C % H == 0,
            "loom's head size is hidden_size / num_attention_heads (loom has no separate head_dim)",
            "use a model whose head_dim * num_attention_heads == hidden_size",
        ),
        (
            "attention_bias",
            not hf_cfg.get("attention_bias", False),
            "loom's moe family has no biases",
            None,
        ),
        (
            "use_sliding_window",
            not hf_cfg.get("use_sliding_window", False),
            "loom's attention is full causal attention",
            None,
        ),
        ("num_experts", E >= 1, "loom's moe family needs routed experts", None),
        ("num_experts_per_tok", 1 <= k <= max(E, 1), "it must be between 1 and num_experts", None),
        ("decoder_sparse_step", step >= 1, "it must be at least 1", None),
        (
            "norm_topk_prob",
            bool(_get(hf_cfg, "norm_topk_prob")) == (k > 1),
            "loom renormalises the top-k weights when k > 1 and keeps one expert's softmax probability "
            f"when k = 1 (here num_experts_per_tok={k})",
            "loom's config has no key to change this; import a model with norm_topk_prob="
            f"{str(k > 1).lower()}",
        ),
    ]
    for key, ok, why, hint in checks:
        if not ok:
            raise LoomError(f"'{path}': {key}={hf_cfg.get(key)!r} cannot be imported: {why}", hint=hint)
    if not sparse_layers(hf_cfg):
        raise LoomError(
            f"'{path}': no layer is sparse (mlp_only_layers={hf_cfg.get('mlp_only_layers')}, "
            f"decoder_sparse_step={step}), so it is not a mixture of experts loom's moe family can hold",
        )
    _loom_layout(hf_cfg, path)
    # rope type (the default only: MoEConfig has no scaling), activation, key/value heads, pretraining_tp
    hf_llama.check_config(hf_cfg, path, ("default",))


def moe_config(hf_cfg: dict, block_size: int | None = None, dropout: float = 0.0) -> MoEConfig:
    """loom's MoEConfig for a Qwen3MoeForCausalLM config.json (block_size free with RoPE; default: the
    model's max_position_embeddings). Balancing options stay at their defaults (the run's to choose)."""
    H = _get(hf_cfg, "num_attention_heads")
    K = _get(hf_cfg, "num_key_value_heads") or H
    first, every = _loom_layout(hf_cfg, "config.json")
    return MoEConfig(
        vocab_size=_get(hf_cfg, "vocab_size"),
        n_layer=_get(hf_cfg, "num_hidden_layers"),
        n_head=H,
        n_embd=_get(hf_cfg, "hidden_size"),
        block_size=block_size or _get(hf_cfg, "max_position_embeddings"),
        dropout=dropout,
        bias=False,
        pos="rope",
        rope_theta=hf_llama._rope_theta(hf_cfg),
        norm="rmsnorm",
        norm_eps=float(_get(hf_cfg, "rms_norm_eps")),
        mlp="swiglu",
        ffn_hidden=_get(hf_cfg, "intermediate_size"),
        n_kv_head=0 if K == H else K,
        qk_norm=True,
        tie_embeddings=bool(hf_cfg.get("tie_word_embeddings", False)),
        n_experts=_get(hf_cfg, "num_experts"),
        top_k=_get(hf_cfg, "num_experts_per_tok"),
        moe_every=every,
        first_dense=first,
        n_shared=0,
        expert_hidden=_get(hf_cfg, "moe_intermediate_size"),
        score="softmax",
        norm_topk=True,
    )


def model_keys(hf_cfg: dict, block_size: int | None = None, dropout: float = 0.0) -> dict:
    """The model.* keys model.init_from=hf:DIR sets for a Qwen3-MoE directory (the family included)."""
    g = moe_config(hf_cfg, block_size, dropout)
    keys = {k: getattr(g, k) for k in (*hf_io._SHAPE_KEYS, "rope_theta")}
    return {"family": "moe", **keys, **{k: getattr(g, f) for k, f in MOE_KEYS.items()}}


def _experts(sd: dict[str, torch.Tensor], h: str, E: int, H: int, C: int) -> dict[str, torch.Tensor]:
    """A layer's experts as loom's (E, ...) weights, from the fused layout (transformers 5 in memory) or the
    per-expert hub layout (save_pretrained, the released checkpoints)."""

    def get(name: str, shape: tuple) -> torch.Tensor:
        return hf_llama.imported(sd, name, shape, ARCHITECTURE)

    if h + "experts.gate_up_proj" in sd:
        gate_up = get(h + "experts.gate_up_proj", (E, 2 * H, C))  # gate rows, then up rows
        return {
            "gate_proj": gate_up[:, :H],
            "up_proj": gate_up[:, H:],
            "down_proj": get(h + "experts.down_proj", (E, C, H)),
        }
    shapes = {"gate_proj": (H, C), "up_proj": (H, C), "down_proj": (C, H)}
    return {
        n: torch.stack([get(h + f"experts.{e}.{n}.weight", s) for e in range(E)]) for n, s in shapes.items()
    }


def loom_state(sd: dict[str, torch.Tensor], cfg: MoEConfig) -> dict[str, torch.Tensor]:
    """Qwen3MoeForCausalLM tensors -> loom's state dict for `cfg`, vocabulary padded with the mean row (the
    head masks the padding ids' logits, as hf_llama's import)."""
    C = cfg.n_embd

    def get(name: str, shape: tuple) -> torch.Tensor:
        return hf_llama.imported(sd, name, shape, ARCHITECTURE)

    out, shapes = hf_llama.ends_and_shapes(sd, cfg, MoEGPT, ARCHITECTURE)
    for i in range(cfg.n_layer):
        for ours, theirs in hf_llama.layer_names(i):
            if ours in shapes:
                out[ours] = get(theirs, shapes[ours])
        if not cfg.is_moe(i):
            continue
        p, h = f"blocks.{i}.mlp.", f"model.layers.{i}.mlp."
        out[p + "router.weight"] = get(h + "gate.weight", (cfg.n_experts, C))
        experts = _experts(sd, h, cfg.n_experts, cfg.expert_width, C)
        out.update({p + f"experts.{n}": w for n, w in experts.items()})
        out[p + "expert_bias"] = torch.zeros(cfg.n_experts)
    return {k: v.contiguous() for k, v in out.items()}


def _read_config(directory: str | Path) -> dict:
    hf_cfg = hf_io.read_config_json(directory)  # a directory, its config.json, its tokenizer: checked there
    if hf_cfg.get("model_type") != MODEL_TYPE:
        raise LoomError(
            f"'{directory}' holds a '{hf_cfg.get('model_type')}' model; model.family=moe imports "
            f"{ARCHITECTURE} (model_type {MODEL_TYPE}) only",
            hint="leave model.family unset with model.init_from: the imported config.json chooses it",
        )
    check_config(hf_cfg, Path(directory) / "config.json")
    return hf_cfg


@torch.no_grad()
def load_hf_into(model: MoEGPT, directory: str | Path) -> None:
    """Copy Qwen3-MoE weights from a local transformers directory into `model` (shapes must agree)."""
    hf_cfg = _read_config(directory)
    want = moe_config(hf_cfg)
    want = dataclasses.replace(want, **{f: getattr(model.cfg, f) for f in _RUN_FIELDS})
    hf_io.check_same_config(model.cfg, want, directory)
    model.load_state_dict(loom_state(hf_io.read_hf_weights(directory), model.cfg))
    log.info(f"initialised from {ARCHITECTURE} weights in {directory}")


def load_hf(directory: str | Path, block_size: int | None = None, dropout: float = 0.0) -> MoEGPT:
    """A loom MoEGPT holding the Qwen3-MoE model saved in `directory`."""
    model = MoEGPT(moe_config(_read_config(directory), block_size, dropout))
    load_hf_into(model, directory)
    return model
