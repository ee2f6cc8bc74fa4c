"""Model shapes for planning: presets, a config file's [model] section, or a bare parameter count.

Pure arithmetic, no torch: `loom plan` answers in milliseconds on a laptop. The block is loom's transformer
block (model/gpt/gpt.py) with its options: separate q/k/v/o projections (k and v n_kv_head heads wide: grouped-query
attention), a 4·C GELU MLP or a SwiGLU MLP of ffn_hidden (three matrices), LayerNorm or RMSNorm, learned or
rotary positions, and an LM head tied to the token embedding or not. `param_count` equals
the gpt2/llama model's `num_params()` (tested against loom.model.flops.param_count).

A mixture of experts (the moe family, model/moe/moe.py): n_experts > 0 puts routed SwiGLU experts of width
expert_width (top_k of them per token) and n_shared shared ones in place of the MLP of the MoE layers
(from first_dense on, every moe_every-th); a MoE layer also has a router (C x E). `counted_params` counts
every expert (MoEGPT.num_params()), `active_params` the top_k a token passes through (num_active_params()).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, replace

from loom.errors import LoomError


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    bias: bool = False
    dropout: float = 0.0
    assumed: bool = False  # shape derived from a bare parameter count (--params)
    n_params: int | None = None  # the count given with --params; None: counted from the shape
    note: str = ""
    # the llama family's options (model/gpt/gpt.py; defaults: gpt2's block)
    n_kv_head: int = 0  # 0: n_head
    mlp: str = "gelu"  # gelu | swiglu
    ffn_hidden: int = 0  # 0: 4·C (gelu), LLaMA's 8/3·C rounded up to 64 (swiglu)
    norm: str = "layernorm"  # layernorm | rmsnorm (no bias)
    pos: str = "learned"  # learned | rope (no position table)
    tie_embeddings: bool = True
    qk_norm: bool = False
    # the llama family's own keys (its ModelSpec.plan_shape): Qwen3's head width, Qwen 2.5's q/k/v biases
    head_size: int = 0  # 0: n_embd / n_head
    qkv_bias: bool = False
    # the family whose keys these are ("": the default's, gpt2's block with the options above given): the
    # planner's shape of a config names it; a preset with experts names moe (the dry run then takes its keys)
    family: str = ""
    # a mixture of experts' terms (the moe family's ModelSpec.plan_shape; n_experts=0: dense)
    n_experts: int = 0  # routed experts per MoE layer
    top_k: int = 2  # experts per token
    moe_every: int = 1  # every k-th layer from first_dense on is a MoE layer
    first_dense: int = 0  # the first layers keep the dense MLP (DeepSeek-V3: 3)
    n_shared: int = 0  # shared experts, one SwiGLU of n_shared x expert_width
    expert_hidden: int = 0  # an expert's width; 0: ffn_width
    # model.mtp_depth: D multi-token prediction modules (loom.model.mtp), trained with the main model; each
    # multiplies by its 2C -> C projection, one block and the shared head, as loom.model.flops counts them
    mtp_depth: int = 0

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_width(self) -> int:
        """As MoEConfig.expert_width."""
        return self.expert_hidden or self.ffn_width

    @property
    def moe_layers(self) -> list[int]:
        """As MoEConfig.moe_layers: the layers whose MLP is a MoE (none for a dense shape)."""
        if not self.is_moe:
            return []
        return [
            i for i in range(self.first_dense, self.n_layer) if (i - self.first_dense) % self.moe_every == 0
        ]

    def moe_layers_below(self, layer: int) -> int:
        """How many of moe_layers are below `layer`, counted without listing them (the planner asks it ~10^5
        times for a 512-GPU plan)."""
        span = min(layer, self.n_layer) - self.first_dense
        return -(-span // self.moe_every) if self.is_moe and span > 0 else 0

    @property
    def n_moe(self) -> int:
        return self.moe_layers_below(self.n_layer)

    @property
    def routed_params(self) -> int:
        """One MoE layer's routed experts: E x 3 matrices of C x H (gate, up, down; no biases)."""
        return self.n_experts * 3 * self.n_embd * self.expert_width

    @property
    def expert_matrices(self) -> int:
        """What a token is multiplied by in a MoE layer besides attention: the router, its k routed experts
        and the shared ones. Not tensor-parallel: each TP rank runs the MoE layer whole (model/moe_parallel)."""
        return self.n_embd * self.n_experts + 3 * self.n_embd * self.expert_width * (
            self.top_k + self.n_shared
        )

    @property
    def moe_block_params(self) -> int:
        """A MoE block without its routed experts: attention, norms, the router and the shared experts."""
        shared = self.mlp_params(3, self.n_shared * self.expert_width) if self.n_shared else 0
        return (
            self.attn_params() + 2 * self.ln_params + self.qk_params() + self.n_embd * self.n_experts + shared
        )

    @property
    def head_dim(self) -> int:
        """As GPTConfig.head_dim: head_size, else n_embd / n_head."""
        return self.head_size or self.n_embd // self.n_head

    @property
    def q_dim(self) -> int:
        """Width of the query projection and of attention's output: n_head heads (n_embd unless head_size)."""
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key and of the value projection: n_kv_head heads."""
        return (self.n_kv_head or self.n_head) * self.head_dim

    @property
    def ffn_width(self) -> int:
        """As GPTConfig.ffn_width."""
        if self.ffn_hidden:
            return self.ffn_hidden
        return (8 * self.n_embd // 3 + 63) // 64 * 64 if self.mlp == "swiglu" else 4 * self.n_embd

    @property
    def attn_matrices(self) -> int:
        """q and o (C·q_dim: C² unless head_size), k and v (C·kv_dim)."""
        return 2 * self.n_embd * self.q_dim + 2 * self.n_embd * self.kv_dim

    def attn_flops(self, seq_len: int) -> int:
        """Training FLOPs per token of attention's score and value products (loom.model.flops): the MTP
        modules' blocks too."""
        return 12 * (self.n_layer + self.mtp_depth) * self.q_dim * seq_len

    @property
    def layer_matrices(self) -> int:
        """One (dense) block's weight matrices: attention's four, the MLP's two or three."""
        return self.attn_matrices + (3 if self.mlp == "swiglu" else 2) * self.n_embd * self.ffn_width

    def matmul_params(self) -> int:
        """The matrices a token is multiplied by (loom.model.flops.matmul_params): a MoE layer's active
        experts only, the LM head whether tied or not, and per MTP module its projection, block and the head
        once more (counted on all positions, as the trainer's MFU counts them)."""
        dense = (self.n_layer - self.n_moe) * self.layer_matrices
        head = self.padded_vocab * self.n_embd
        mtp = self.mtp_depth * (2 * self.n_embd * self.n_embd + self.layer_matrices + head)
        return dense + self.n_moe * (self.attn_matrices + self.expert_matrices) + head + mtp

    @property
    def padded_vocab(self) -> int:
        """As GPTConfig.padded_vocab: rounded up to a multiple of 64."""
        return (self.vocab_size + 63) // 64 * 64

    @property
    def ln_params(self) -> int:
        return 2 * self.n_embd if self.bias and self.norm == "layernorm" else self.n_embd

    def attn_params(self) -> int:
        """Attention's matrices and biases (q: q_dim, o: C, k and v: kv_dim; qkv_bias: q, k and v only)."""
        if self.bias:
            return self.attn_matrices + self.q_dim + self.n_embd + 2 * self.kv_dim
        return self.attn_matrices + (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0)

    def mlp_params(self, n_matrices: int, width: int) -> int:
        """An MLP of two (GELU) or three (SwiGLU) matrices of C x width, and their biases."""
        return n_matrices * self.n_embd * width + ((n_matrices - 1) * width + self.n_embd if self.bias else 0)

    def qk_params(self) -> int:
        """QK-norm's two gains of a head's size."""
        return 2 * self.head_dim if self.qk_norm else 0

    @property
    def layer_params(self) -> int:
        """One (dense) block: its matrices (12·C² for gpt2's) + two norms (+ QK-norm gains) (+ biases)."""
        mlp = self.mlp_params(3 if self.mlp == "swiglu" else 2, self.ffn_width)
        return self.attn_params() + mlp + 2 * self.ln_params + self.qk_params()

    @property
    def embed_params(self) -> int:
        """Token embedding (also the LM head when tied) + learned positions (none with RoPE)."""
        return self.padded_vocab * self.n_embd + (
            self.block_size * self.n_embd if self.pos == "learned" else 0
        )

    @property
    def head_params(self) -> int:
        """The LM head's matrix: tied, shared with the embedding on one stage and a second copy when pp > 1;
        untied, a tensor of its own on the last stage."""
        return self.padded_vocab * self.n_embd

    def counted_params(self) -> int:
        """Distinct parameters of the shape (a tied head counted once) = the model's num_params()."""
        head = 0 if self.tie_embeddings else self.head_params
        blocks = (self.n_layer - self.n_moe) * self.layer_params
        blocks += self.n_moe * (self.moe_block_params + self.routed_params)
        return self.embed_params + blocks + self.ln_params + head

    def active_params(self) -> int:
        """Parameters one token passes through (MoEGPT.num_active_params()): top_k of a MoE layer's routed
        experts. Scaled as param_count when --params replaces the count."""
        idle = self.n_moe * (self.n_experts - self.top_k) * 3 * self.n_embd * self.expert_width
        return round((self.counted_params() - idle) * self.param_count() / self.counted_params())

    def param_count(self) -> int:
        """Ψ: the count given with --params, else the shape's own count."""
        return self.n_params if self.n_params is not None else self.counted_params()

    def describe(self) -> str:
        s = (
            f"{self.name}: {fmt_count(self.param_count())} parameters, n_layer={self.n_layer} "
            f"n_head={self.n_head} n_embd={self.n_embd} vocab={self.vocab_size} block_size={self.block_size}"
        )
        if (self.mlp, self.norm, self.pos, self.tie_embeddings, self.n_kv_head) != (
            "gelu",
            "layernorm",
            "learned",
            True,
            0,
        ):
            s += (
                f" n_kv_head={self.n_kv_head or self.n_head} {self.mlp} {self.ffn_width} {self.norm} {self.pos}"
                f"{'' if self.tie_embeddings else ' untied'}"
            )
        if self.head_size or self.qkv_bias or self.qk_norm:
            s += f" head_size={self.head_dim}" + " qkv_bias" * self.qkv_bias + " qk_norm" * self.qk_norm
        if self.is_moe:
            s += (
                f"; MoE: {self.n_experts} routed experts (top-{self.top_k}"
                f"{f' + {self.n_shared} shared' if self.n_shared else ''}) of width {self.expert_width} in "
                f"{self.n_moe} of {self.n_layer} layers, {fmt_count(self.active_params())} active parameters"
            )
        if self.mtp_depth:  # their FLOPs are in the time estimate; their parameters and memory are not
            s += f"; {self.mtp_depth} multi-token prediction modules (in the FLOPs; not in the parameters or memory)"
        if self.assumed:
            s += " (shape assumed for activations: only the parameter count was given)"
        return s + (f"; {self.note}" if self.note else "")


_GPT2 = dict(vocab_size=50257, block_size=1024, bias=True)
_LLAMA_NOTE = (
    "loom's gpt2 block at LLaMA's depth and width (4·C GELU MLP, tied head, 32k vocabulary); "
    "the llama-family presets (llama2-7b, llama3-8b, llama3-70b) have Llama's own block"
)
_LLAMA = dict(mlp="swiglu", norm="rmsnorm", pos="rope", tie_embeddings=False)
# gpt2 shapes from Radford et al. 2019 / the released checkpoints; 7B/13B/70B at LLaMA's (Touvron et al.
# 2023) n_layer / n_embd / n_head with context 4096 (LLaMA 2). loom can build all of them; the large ones
# are for planning, not for a CPU.
PRESETS: dict[str, ModelShape] = {
    "gpt2": ModelShape("gpt2 (124M)", 12, 12, 768, **_GPT2),
    "gpt2-medium": ModelShape("gpt2-medium (350M)", 24, 16, 1024, **_GPT2),
    "gpt2-large": ModelShape("gpt2-large (774M)", 36, 20, 1280, **_GPT2),
    "gpt2-xl": ModelShape("gpt2-xl (1.5B)", 48, 25, 1600, **_GPT2),
    "7b": ModelShape("7B-class", 32, 32, 4096, 32000, 4096, note=_LLAMA_NOTE),
    "13b": ModelShape("13B-class", 40, 40, 5120, 32000, 4096, note=_LLAMA_NOTE),
    "70b": ModelShape("70B-class", 80, 64, 8192, 32000, 4096, note=_LLAMA_NOTE),
    # Touvron et al. 2023 (Llama 2: 6.74B) and Meta's Llama 3 model card / torchtitan's llama3 args (8.03B,
    # 70.55B): SwiGLU widths 11008 / 14336 / 28672, 8 key/value heads for Llama 3, vocabulary 32000 / 128256.
    "llama2-7b": ModelShape("llama2-7b", 32, 32, 4096, 32000, 4096, ffn_hidden=11008, **_LLAMA),
    "llama3-8b": ModelShape("llama3-8b", 32, 32, 4096, 128256, 8192, n_kv_head=8, ffn_hidden=14336, **_LLAMA),
    "llama3-70b": ModelShape(
        "llama3-70b", 80, 64, 8192, 128256, 8192, n_kv_head=8, ffn_hidden=28672, **_LLAMA
    ),
    # mixtures of experts, as configs/deepseek_v3_shaped.toml and configs/qwen3_30b_a3b.toml (whose comments
    # say how loom's block differs from the originals: GQA attention for DeepSeek-V3's MLA, 16 heads of 128
    # for Qwen3's 32 with q wider than the model)
    "deepseek-v3-shaped": ModelShape(
        "deepseek-v3-shaped",
        61,
        128,
        7168,
        129280,
        4096,
        n_kv_head=128,
        ffn_hidden=18432,
        **_LLAMA,
        family="moe",
        n_experts=256,
        top_k=8,
        first_dense=3,
        n_shared=1,
        expert_hidden=2048,
    ),
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b",
        48,
        16,
        2048,
        151936,
        4096,
        n_kv_head=4,
        ffn_hidden=6144,
        qk_norm=True,
        **_LLAMA,
        family="moe",
        n_experts=128,
        top_k=8,
        expert_hidden=768,
    ),
}
ALIASES = {
    "124m": "gpt2",
    "gpt2-124m": "gpt2",
    "350m": "gpt2-medium",
    "gpt2-350m": "gpt2-medium",
    "774m": "gpt2-large",
    "gpt2-774m": "gpt2-large",
    "1.5b": "gpt2-xl",
    "gpt2-1.5b": "gpt2-xl",
    "llama-7b": "7b",
    "llama-13b": "13b",
    "llama-70b": "70b",
    "deepseek-v3": "deepseek-v3-shaped",
    "qwen3-30b": "qwen3-30b-a3b",
}

_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str) -> int:
    """'7.5B' -> 7_500_000_000; '124M', '1.5e9', '350000000' also work."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise LoomError(
            f"cannot read a parameter count from '{text}'", hint="write it like 7.5B, 124M or 1.3e9"
        )
    return int(round(float(m.group(1)) * _SUFFIX[m.group(2).upper()]))


def fmt_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}" if n / div < 100 else f"{n / div:.0f}{unit}"
    return str(int(n))


def shape_for_params(n: int, vocab_size: int = 50257, block_size: int = 2048) -> ModelShape:
    """An assumed shape for a bare count: Ψ ≈ 12·L·C² with C/L ≈ 128 (gpt3's and LLaMA's aspect ratio:
    4096/32, 12288/96), C a multiple of 128 and head size 128 (64 below C = 1024)."""
    C = max(128, round((n * 128 / 12) ** (1 / 3) / 128) * 128)
    head = 128 if C >= 1024 else 64
    L = max(1, round((n - vocab_size * C) / (12 * C * C)))
    return ModelShape(
        f"{fmt_count(n)} parameters", L, C // head, C, vocab_size, block_size, assumed=True, n_params=n
    )


def shape_from_config(path: str) -> ModelShape:
    """The [model] section of a loom TOML config (defaults filled in by loom.config)."""
    from loom.config import load_config
    from loom.model.registry import load_plugins

    load_plugins()  # its family's preset and own keys (a plug-in's too)
    m = load_config(path).model
    note = ""
    vocab = m.vocab_size
    if not vocab:
        vocab, note = 50257, "model.vocab_size=0 (taken from the data): assumed gpt2's 50257"
    return shape_of_model(m, vocab, path, note)


def shape_of_model(m, vocab_size: int, name: str = "config", note: str = "") -> ModelShape:
    """The shape of a loom.config.ModelConfig (its family's preset applied) with this vocabulary: GPT's block
    from the common keys, and what the family's own keys add (its ModelSpec.plan_shape: a MoE's experts)."""
    from loom.model.registry import get  # (a config file's family may be a plug-in: loom.model loads it)

    return ModelShape(
        name,
        m.n_layer,
        m.n_head,
        m.n_embd,
        vocab_size,
        m.block_size,
        m.bias,
        m.dropout,
        note=note,
        n_kv_head=m.n_kv_head,
        mlp=m.mlp,
        ffn_hidden=m.ffn_hidden,
        norm=m.norm,
        pos=m.pos,
        tie_embeddings=m.tie_embeddings,
        qk_norm=m.qk_norm,
        family=m.family,
        mtp_depth=m.mtp_depth,
        **get(m.family).plan_shape(m),
    )


def resolve_model(model: str | None, params: str | None) -> ModelShape:
    """--model PRESET|CONFIG.toml and/or --params N. With both, the count replaces the shape's own."""
    if model is None and params is None:
        raise LoomError(
            "give a model to plan for", hint="--model 7b (or gpt2, a CONFIG.toml) or --params 7.5B"
        )
    if model is None:
        return shape_for_params(parse_count(params))
    key = ALIASES.get(model.lower(), model.lower())
    if key in PRESETS:
        shape = PRESETS[key]
    elif model.endswith(".toml"):
        shape = shape_from_config(model)
    else:
        close = difflib.get_close_matches(key, list(PRESETS) + list(ALIASES), n=1)
        raise LoomError(
            f"unknown model '{model}'" + (f"; did you mean '{close[0]}'?" if close else ""),
            hint=f"a preset ({', '.join(PRESETS)}), a CONFIG.toml, or --params N",
        )
    return replace(shape, n_params=parse_count(params)) if params else shape


def assert_valid(shape: ModelShape) -> None:
    """The model's own rules (as GPTConfig / config.validate): heads divide the width."""
    if shape.n_embd % shape.n_head:
        raise LoomError(
            f"n_embd={shape.n_embd} is not divisible by n_head={shape.n_head}",
            hint="pick n_head among the divisors of n_embd",
        )
    if shape.n_kv_head and shape.n_head % shape.n_kv_head:
        raise LoomError(
            f"n_head={shape.n_head} is not divisible by n_kv_head={shape.n_kv_head}",
            hint="pick n_kv_head among the divisors of n_head",
        )
    if shape.is_moe and not (1 <= shape.top_k <= shape.n_experts and shape.n_moe):
        raise LoomError(
            f"a mixture of experts needs 1 <= top_k <= n_experts and a MoE layer; got top_k={shape.top_k}, "
            f"n_experts={shape.n_experts}, first_dense={shape.first_dense} of {shape.n_layer} layers",
            hint="check the model.moe_* keys",
        )
    if min(
        shape.n_layer, shape.n_head, shape.n_embd, shape.vocab_size, shape.block_size
    ) < 1 or not math.isfinite(shape.dropout):
        raise LoomError(f"model shape {shape} has a non-positive size", hint="check the [model] section")
