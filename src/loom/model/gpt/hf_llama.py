"""Llama interoperability with Hugging Face transformers: LlamaForCausalLM directories both ways, and the two
Qwen dense models built on the same layout: Qwen2ForCausalLM (Qwen 2 / 2.5: biases on q, k and v only, loom's
model.qkv_bias) and Qwen3ForCausalLM (Qwen 3 dense: RMSNorm of each query and key head, model.qk_norm).

A loom model of the llama family (pos=rope, norm=rmsnorm, mlp=swiglu) is LlamaForCausalLM's architecture
with the same module layout, so the mapping is by name only, no transposes or permutations: loom's RoPE
pairs channel i with i + D/2 as transformers' Llama does (the HF conversion already permuted Meta's weights).

  loom                                   LlamaForCausalLM (transformers)
  wte.weight (V_padded, C)               model.embed_tokens.weight (V, C)                 rows [:V]
  blocks.i.ln_1 / ln_2                   model.layers.i.input_layernorm / post_attention_layernorm
  blocks.i.attn.{q,k,v,o}_proj           model.layers.i.self_attn.{q,k,v,o}_proj         (K*D rows for k, v)
  blocks.i.mlp.{gate,up,down}_proj       model.layers.i.mlp.{gate,up,down}_proj
  ln_f                                   model.norm
  lm_head.weight (V_padded, C)           lm_head.weight (V, C); absent when tie_word_embeddings

  blocks.i.attn.{q,k}_norm (D,)           model.layers.i.self_attn.{q,k}_norm              (Qwen3)

RoPE: default, linear, llama3 (Llama 3.1-3.3) and yarn frequencies are computed as transformers computes them
(gpt.rope_inv_freq); a config with another rope type (dynamic, longrope, ...) is refused, naming it,
rather than imported with silently different positions.
"""

from __future__ import annotations

import math

import torch

from loom.errors import LoomError
from loom.model.gpt.gpt import GPT, ROPE_TYPES, GPTConfig, Rope

ARCHITECTURE = "LlamaForCausalLM"
# config.json's model_type -> the transformers class of each architecture this mapping reads and writes
ARCHITECTURES = {"llama": ARCHITECTURE, "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# the llama family's own keys (family.LlamaKeys), GPTConfig fields an import sets beside the shape keys
FAMILY_KEYS = (
    "rope_type",
    "rope_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_context",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_attention_factor",
    "qkv_bias",
    "head_size",
)


# ------------------------------------------------------------------------------------------- export


def model_type(cfg: GPTConfig) -> str:
    """The architecture a loom model exports as: qwen3 with QK-norm, qwen2 with q/k/v biases, else llama."""
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def check_exportable(cfg: GPTConfig) -> None:
    """Refuse, naming the field, a loom model that none of Llama, Qwen2 and Qwen3 has a setting for."""
    kind = model_type(cfg)
    want = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu"}
    if kind != "llama":  # Qwen's MLPs have no biases; Qwen3 has q/k/v/o biases or none
        want |= {"bias": False, "qkv_bias": False} if kind == "qwen3" else {"bias": False}
    for key, value in want.items():
        if getattr(cfg, key) != value:
            raise LoomError(
                f"{ARCHITECTURES[kind]} cannot represent this model: model.{key}={getattr(cfg, key)!r} is not "
                f"its {value!r}",
                hint="export models of model.family=llama (qk_norm: as Qwen3, qkv_bias: as Qwen2, without "
                "model.bias) or GPT-2-shaped models",
            )


def rope_parameters(cfg: GPTConfig) -> dict:
    """config.json's rope_parameters for loom's model.rope_* keys (transformers 5's names)."""
    rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type in ("linear", "llama3", "yarn"):
        rope["factor"] = cfg.rope_factor
    if cfg.rope_type == "yarn":  # the attention factor written out: no mscale for the reader to apply
        rope |= {
            "original_max_position_embeddings": cfg.rope_original_context,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "attention_factor": Rope.of(cfg).scale,
        }
    if cfg.rope_type == "llama3":
        rope |= {
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context,
        }
    return rope


def llama_config(cfg: GPTConfig, eot_id: int | None = None) -> dict:
    """config.json of a LlamaForCausalLM (Qwen2ForCausalLM, Qwen3ForCausalLM: model_type) with loom's shape
    (vocabulary unpadded)."""
    check_exportable(cfg)
    kind = model_type(cfg)
    out = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.ffn_width,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope_parameters(cfg),
        "rope_theta": cfg.rope_theta,  # the second for transformers 4.x readers
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "torch_dtype": "float32",
    }
    if kind != "llama":  # Qwen's keys: full attention in every layer; Qwen2's q/k/v biases need no key
        out |= {"use_sliding_window": False, "sliding_window": None}
        for key in ("mlp_bias", "pretraining_tp") + (("attention_bias",) if kind == "qwen2" else ()):
            del out[key]
    return out


def llama_state_dict(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """loom weights (fp32 on the host, by loom's names) in LlamaForCausalLM's names, vocabulary unpadded."""
    check_exportable(cfg)
    V = cfg.vocab_size
    out = {"model.embed_tokens.weight": sd["wte.weight"][:V], "model.norm.weight": sd["ln_f.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"][:V]
    for i in range(cfg.n_layer):
        for ours, theirs in layer_names(i):
            if ours in sd:  # biases only with model.bias
                out[theirs] = sd[ours]
    return {k: v.contiguous() for k, v in out.items()}


def layer_names(i: int) -> list[tuple[str, str]]:
    """(loom, transformers) names of layer i's tensors; those a model lacks (biases, QK-norm) are skipped."""
    p, h = f"blocks.{i}.", f"model.layers.{i}."
    pairs = [
        (p + "ln_1.weight", h + "input_layernorm.weight"),
        (p + "ln_2.weight", h + "post_attention_layernorm.weight"),
    ]
    pairs += [(p + f"attn.{n}_norm.weight", h + f"self_attn.{n}_norm.weight") for n in "qk"]
    for n in "qkvo":
        pairs += [(p + f"attn.{n}_proj.{w}", h + f"self_attn.{n}_proj.{w}") for w in ("weight", "bias")]
    for n in ("gate", "up", "down"):
        pairs += [(p + f"mlp.{n}_proj.{w}", h + f"mlp.{n}_proj.{w}") for w in ("weight", "bias")]
    return pairs


# ------------------------------------------------------------------------------------------- import


def peft_modules(n_layer: int) -> dict[str, str]:
    """{loom's linear: transformers' module} of a Llama (the weight names above, without `.weight`): the names
    peft's adapters target (export --format peft, the llama family's ModelSpec.peft)."""
    pairs = [p for i in range(n_layer) for p in layer_names(i) if p[0].endswith(".weight")]
    return {ours.removesuffix(".weight"): theirs.removesuffix(".weight") for ours, theirs in pairs} | {
        "lm_head": "lm_head"
    }


def _rope_spec(hf: dict) -> dict:
    """The RoPE settings of a config.json: transformers 5 writes rope_parameters, 4.x rope_scaling (with
    rope_theta beside it); the first that names a rope type other than the default, else rope_parameters."""
    specs = [hf.get(key) for key in ("rope_parameters", "rope_scaling")]
    specs = [s for s in specs if isinstance(s, dict)]
    scaled = [s for s in specs if s.get("rope_type", s.get("type", "default")) != "default"]
    return (scaled or specs or [{}])[0]


def _rope_type(hf: dict) -> str:
    spec = _rope_spec(hf)
    return spec.get("rope_type", spec.get("type", "default"))


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf.get("rope_theta", 10000.0))


def rope_keys(hf: dict) -> dict:
    """GPTConfig's rope_* fields (model.rope_* keys) of a config.json; llama3's original context falls back to
    max_position_embeddings, as transformers' does."""
    spec, kind = _rope_spec(hf), _rope_type(hf)
    keys = {"rope_theta": _rope_theta(hf), "rope_type": kind}
    if kind in ("linear", "llama3", "yarn"):
        keys["rope_factor"] = float(spec["factor"])
    if kind == "yarn":
        keys |= yarn_keys(spec, hf)
    if kind == "llama3":
        keys |= {
            "rope_low_freq_factor": float(spec["low_freq_factor"]),
            "rope_high_freq_factor": float(spec["high_freq_factor"]),
            "rope_original_context": int(
                spec.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 8192)
            ),
        }
    return keys


def yarn_keys(spec: dict, hf: dict) -> dict:
    """model.rope_* keys of YaRN parameters, the attention factor resolved as transformers resolves it (from
    mscale and mscale_all_dim when given, else 0.1 ln(factor) + 1)."""
    factor = float(spec["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = spec.get("attention_factor")
    if attention is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    return {
        "rope_original_context": int(
            spec.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 8192)
        ),
        "rope_beta_fast": float(spec.get("beta_fast") or 32.0),
        "rope_beta_slow": float(spec.get("beta_slow") or 1.0),
        "rope_attention_factor": float(attention),
    }


def check_rope(hf: dict, path, supported: tuple[str, ...] = ROPE_TYPES) -> None:
    """A rope type loom does not compute, named with the ones it does, before any weight is read."""
    rope = _rope_type(hf)
    if rope not in supported:
        raise LoomError(
            f"'{path}': rope type '{rope}' is not implemented in loom (supported: {', '.join(supported)}); "
            "importing it would silently train with other positions",
            hint=f"use a model whose config.json has rope_type {' or '.join(repr(t) for t in supported)}",
        )
    spec = _rope_spec(hf)
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(rope, ())
    missing = [
        k for k in need + (("factor",) if rope == "yarn" else ()) if not isinstance(spec.get(k), (int, float))
    ]
    if missing:
        raise LoomError(f"'{path}': rope type '{rope}' needs {', '.join(missing)} in its rope parameters")
    # what loom's RoPE has no key for: rotating part of each head, YaRN's untruncated ramp
    for key, ok in (
        (
            "partial_rotary_factor",
            spec.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) == 1.0,
        ),
        ("truncate", spec.get("truncate", True) is not False),
    ):
        if not ok:
            raise LoomError(
                f"'{path}': the rope parameter {key} cannot be imported: loom has no setting for it"
            )


def check_config(hf: dict, path, rope_types: tuple[str, ...] = ROPE_TYPES) -> None:
    """What loom's llama family cannot represent, named with the key (before any weight is read)."""
    C, H = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    K = hf.get("num_key_value_heads") or H
    check_rope(hf, path, rope_types)
    head_dim = hf.get("head_dim") or C // H
    checks = [
        ("hidden_act", hf.get("hidden_act", "silu") == "silu", "loom's SwiGLU uses silu"),
        ("head_dim", head_dim % 2 == 0 and (C % H == 0 or "head_dim" in hf), "RoPE turns pairs of channels"),
        ("num_key_value_heads", H % K == 0, "it must divide num_attention_heads"),
        (
            "mlp_bias",
            bool(hf.get("mlp_bias", False)) == bool(hf.get("attention_bias", False))
            or hf.get("model_type") == "qwen3",
            "loom has one model.bias for attention and MLP (attention_bias must equal mlp_bias)",
        ),
        ("pretraining_tp", hf.get("pretraining_tp", 1) in (None, 1), "loom computes each projection whole"),
        (
            "use_sliding_window",
            not hf.get("use_sliding_window", False),
            "loom's attention is full in every layer",
        ),
    ]
    if hf.get("model_type") == "qwen3":  # its MLP has no biases: attention_bias has no loom key
        checks.append(
            ("attention_bias", not hf.get("attention_bias", False), "loom's model.bias is everywhere")
        )
    for key, ok, why in checks:
        if not ok:
            raise LoomError(f"'{path}': {key}={hf.get(key)!r} cannot be imported: {why}")


def gpt_config(hf: dict, block_size: int | None = None, dropout: float = 0.0) -> GPTConfig:
    """loom's GPTConfig for a LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM config.json (RoPE:
    block_size is free; default: the model's max_position_embeddings)."""
    H, C = hf.get("num_attention_heads", 32), hf.get("hidden_size", 4096)
    K = hf.get("num_key_value_heads") or H
    kind = hf.get("model_type", "llama")
    head_dim = hf.get("head_dim") or C // H
    return GPTConfig(
        vocab_size=hf.get("vocab_size", 32000),
        n_layer=hf.get("num_hidden_layers", 32),
        n_head=H,
        n_embd=C,
        head_size=0 if head_dim * H == C else head_dim,
        block_size=block_size or hf.get("max_position_embeddings", 2048),
        dropout=dropout,
        bias=kind == "llama" and bool(hf.get("attention_bias", False)),
        pos="rope",
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        mlp="swiglu",
        ffn_hidden=hf.get("intermediate_size", 11008),
        n_kv_head=0 if K == H else K,
        qk_norm=kind == "qwen3",
        qkv_bias=kind == "qwen2",  # Qwen 2 / 2.5 always have them
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **rope_keys(hf),
    )


def imported(sd: dict[str, torch.Tensor], name: str, shape: tuple, architecture: str) -> torch.Tensor:
    """sd[name], checked to exist and to have the shape the imported config.json implies."""
    if name not in sd:
        raise LoomError(
            f"the imported weights have no '{name}'", hint=f"is this a {architecture} checkpoint?"
        )
    t = sd[name]
    if tuple(t.shape) != shape:
        raise LoomError(f"imported '{name}' has shape {tuple(t.shape)}, config.json implies {shape}")
    return t


def ends_and_shapes(
    sd: dict[str, torch.Tensor], cfg: GPTConfig, model_class: type, architecture: str
) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(loom's embedding, final norm and head from a Llama-shaped checkpoint's model.embed_tokens, model.norm
    and lm_head, the vocabulary padded with the mean row: the head masks the padding ids' logits, so they take
    no probability; the shapes of every tensor of model_class(cfg), built on the meta device)."""
    C, V = cfg.n_embd, cfg.vocab_size

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.mean(dim=0, keepdim=True).expand(cfg.padded_vocab - V, C)])

    wte = padded(imported(sd, "model.embed_tokens.weight", (V, C), architecture))
    out = {"wte.weight": wte, "ln_f.weight": imported(sd, "model.norm.weight", (C,), architecture)}
    head = wte if cfg.tie_embeddings else padded(imported(sd, "lm_head.weight", (V, C), architecture))
    out["lm_head.weight"] = head
    with torch.device("meta"):  # no memory
        shapes = {k: tuple(v.shape) for k, v in model_class(cfg).state_dict().items()}
    return out, shapes


def loom_state(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM tensors -> loom's state dict for `cfg`, vocabulary padded with the mean row (as the
    GPT-2 import)."""

    def get(name: str, shape: tuple) -> torch.Tensor:
        return imported(sd, name, shape, ARCHITECTURE)

    out, shapes = ends_and_shapes(sd, cfg, GPT, ARCHITECTURE)
    for i in range(cfg.n_layer):
        for ours, theirs in layer_names(i):
            if ours in shapes:
                out[ours] = get(theirs, shapes[ours])
    return {k: v.contiguous() for k, v in out.items()}
