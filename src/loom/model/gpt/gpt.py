"""A GPT for one device, readable top to bottom.

Shapes: B batch, T time (tokens), C = n_embd channels, H query heads, K key/value heads (H for GPT-2, fewer
with grouped-query attention), D = C / H head size (or head_size: H * D may differ from C), V padded vocabulary.
Parallelism is applied from outside (loom.parallel); nothing here knows about ranks. Attention keeps separate
q/k/v projections and infers the number of local heads from the projection width, so tensor parallelism can
shard heads without touching this file.

Two families share the file, each part chosen by a config field (all combinable; GPT-2 is the default):
  GPT-2 (Radford et al. 2019)   learned positions, LayerNorm, GELU MLP of width 4C, tied head, biases
  Llama (Touvron et al. 2023)   rotary positions (pos="rope"), RMSNorm, SwiGLU MLP, grouped-query attention
                                (n_kv_head < n_head), untied head, no biases; optional QK-norm (qk_norm)
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom.model.cpu_paths import Dropout, causal_attention
from loom.model.doc_mask import DocMask, build_doc_mask, doc_attention
from loom.model.kv_cache import KVCache, RowCache
from loom.model.lora import init_lora_param
from loom.model.mtp import MTPModule, mtp_hidden, mtp_loss
from loom.model.mup import mup_attention_mult, mup_init_mult
from loom.model.vocab import mask_padding_


@dataclass
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128
    dropout: float = 0.0
    bias: bool = False
    activation: str = "gelu_tanh"  # GPT-2's tanh approximation; "gelu": exact (erf), as nanoGPT
    pos: str = "learned"  # "rope": rotary embeddings on q and k, no position table (Su et al. 2021)
    rope_theta: float = 10000.0  # RoPE's base period; Llama 3 uses 500000 for long contexts
    # RoPE's frequencies: "default" | "linear" (all divided by rope_factor) | "llama3" (Llama 3.1: the long
    # wavelengths divided by rope_factor, the short ones kept, a smooth blend between) | "yarn" (the same by
    # rotations in the original context, and cos/sin scaled; Peng et al. 2023): rope_inv_freq
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_context / this are divided
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_context / this are kept
    rope_original_context: int = 8192  # llama3, yarn: the context the model was pretrained on before scaling
    rope_beta_fast: float = (
        32.0  # yarn: dimensions turning more than this often in the original context are kept
    )
    rope_beta_slow: float = 1.0  # yarn: those turning less often than this are divided by rope_factor
    rope_attention_factor: float = 0.0  # yarn: cos and sin scaled by it; 0: YaRN's 0.1 ln(factor) + 1
    norm: str = "layernorm"  # "rmsnorm": no mean subtraction, no bias (Zhang & Sennrich 2019)
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # "swiglu": down(silu(gate(x)) * up(x)) (Shazeer 2020)
    ffn_hidden: int = 0  # MLP width; 0: the rule of `ffn_width`
    n_kv_head: int = 0  # key/value heads; 0: n_head (multi-head), 1: multi-query, between: grouped-query
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (OLMo 2, Qwen 3, modded-nanogpt)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen 2 and 2.5); `bias` puts them everywhere
    head_size: int = 0  # each attention head's width D; 0: n_embd / n_head (Qwen3-0.6B: 128 with 1024 / 16)
    tie_embeddings: bool = True  # the head shares the token embedding (GPT-2); Llama unties them
    doc_mask: bool = False  # attention within each document of a packed window only (model/doc_mask.py)
    eot_id: int = -1  # doc_mask: the end-of-text id that opens each document (the data's tokenizer's)
    doc_positions: str = "continue"  # doc_mask: "restart" counts positions from 0 in each document
    # μP (model.mup; loom.model.mup has the table and its source): the width the hyperparameters were tuned
    # at; 0: standard parametrisation. At n_embd == mup_base_width μP and SP are the same model.
    mup_base_width: int = 0
    # multi-token prediction (model.mtp_depth, loom.model.mtp): DeepSeek-V3's sequential modules, each a block
    # predicting one token further ahead, sharing wte and the head; their loss weighs mtp_weight in training
    mtp_depth: int = 0
    mtp_weight: float = 0.3

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def ffn_width(self) -> int:
        """The MLP's hidden width: ffn_hidden, else 4C for GELU and for SwiGLU 2/3 of 4C rounded up to a
        multiple of 64, LLaMA's rule, which keeps the parameters of a 4C GELU MLP with three matrices."""
        if self.ffn_hidden:
            return self.ffn_hidden
        if self.mlp == "swiglu":
            return (8 * self.n_embd // 3 + 63) // 64 * 64
        return 4 * self.n_embd

    @property
    def mup_width_mult(self) -> float:
        """μP's width multiplier m = n_embd / mup_base_width (1.0 without μP)."""
        return self.n_embd / self.mup_base_width if self.mup_base_width else 1.0

    @property
    def padded_vocab(self) -> int:
        """Vocabulary rounded up to a multiple of 64: tensor-core friendly and divisible by small TP degrees."""
        return (self.vocab_size + 63) // 64 * 64


ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # transformers' rope_type values rope_inv_freq computes


@dataclass(frozen=True)
class Rope:
    """RoPE's settings (GPTConfig's rope_* fields): the base period and how the frequencies are scaled."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0

    @classmethod
    def of(cls, cfg: GPTConfig) -> Rope:
        return cls(
            cfg.rope_theta,
            cfg.rope_type,
            cfg.rope_factor,
            cfg.rope_low_freq_factor,
            cfg.rope_high_freq_factor,
            cfg.rope_original_context,
            cfg.rope_beta_fast,
            cfg.rope_beta_slow,
            cfg.rope_attention_factor,
        )

    @property
    def scale(self) -> float:
        """What cos and sin are multiplied by: 1, or YaRN's attention factor (0.1 ln(factor) + 1 unless set)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def yarn_inv_freq(head_dim: int, rope: Rope, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (transformers' _compute_yarn_parameters, truncate=True): dimension pairs that turn
    more than beta_fast times within the original context keep theirs, those turning fewer than beta_slow
    times are divided by the factor, a linear ramp between."""

    def dim_of(rotations: float) -> float:  # the pair index turning `rotations` times in the original context
        return (
            head_dim
            * math.log(rope.original_context / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low = max(math.floor(dim_of(rope.beta_fast)), 0)
    high = min(math.ceil(dim_of(rope.beta_slow)), head_dim - 1)
    high = high + 0.001 if low == high else high
    pairs = torch.arange(head_dim // 2, dtype=torch.float, device=inv_freq.device)
    keep = 1 - ((pairs - low) / (high - low)).clamp(0, 1)
    # as transformers computes it, 1 / (factor * theta^(2i/D)) rather than inv_freq / factor: the same bits
    pos_freqs = rope.theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float, device=inv_freq.device) / head_dim
    )
    return 1.0 / (rope.factor * pos_freqs) * (1 - keep) + inv_freq * keep


def rope_inv_freq(head_dim: int, rope: Rope | float, device=None) -> torch.Tensor:
    """The D/2 rotation speeds theta^(-2i/D), scaled as rope.type says (transformers' modeling_rope_utils):
    linear divides all by the factor; llama3 (Llama 3.1) divides those whose wavelength exceeds
    original_context / low_freq_factor, keeps those under original_context / high_freq_factor and blends
    linearly in 1/wavelength between, so short-range positions stay as pretrained and long ones stretch."""
    rope = rope if isinstance(rope, Rope) else Rope(rope)
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim)
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "yarn":
        return yarn_inv_freq(head_dim, rope, inv_freq)
    if rope.type != "llama3":
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low, high = rope.original_context / rope.low_freq_factor, rope.original_context / rope.high_freq_factor
    scaled = torch.where(wavelen > low, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high) & (wavelen <= low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(
    start: int, T: int, head_dim: int, theta: Rope | float, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, D) for positions start .. start+T-1: channel i and i + D/2 of a head turn together by
    position * theta^(-2i/D) (scaled: rope_inv_freq). The half-split pairing is transformers' Llama layout (its
    weights load as they are; Meta's original checkpoints pair neighbours and are permuted by the HF
    conversion). fp32 throughout."""
    return rope_cos_sin_at(torch.arange(start, start + T, dtype=torch.float, device=device), head_dim, theta)


def rope_cos_sin_at(
    positions: torch.Tensor, head_dim: int, theta: Rope | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., D) of the positions (...,) given: (T,) -> (T, D), (B, T) -> (B, T, D)."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # (..., D/2)
    angles = torch.cat((freqs, freqs), dim=-1)
    scale = theta.scale if isinstance(theta, Rope) else 1.0
    if scale != 1.0:  # YaRN: sharper attention at the longer context
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) queries or keys by their positions' angles."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype, cast once for the projections that read it (q, k and v; SwiGLU's gate and up).

    Autocast casts a matmul's fp32 input at every call, and each cast is a tensor of its own kept for backward:
    three copies of the normed input in attention, two in the MLP (full-length ones under sequence parallel,
    where they follow the all-gather). Cast here, before the sub-layer, there is one, and sequence parallel
    all-gathers it in the compute dtype: half the bytes. The values are the ones autocast would compute."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return x
    return x.to(torch.get_autocast_dtype(device))


def norm_layer(cfg: GPTConfig, dim: int) -> nn.Module:
    """LayerNorm (GPT-2; bias with model.bias) or RMSNorm (Llama): a gain per channel, eps cfg.norm_eps."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        C, D = cfg.n_embd, cfg.head_dim
        # RoPE's settings (Rope), None with learned positions
        self.head_dim, self.rope = D, Rope.of(cfg) if cfg.pos == "rope" else None
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.q_proj = nn.Linear(C, cfg.n_head * D, bias=qkv_bias)
        self.k_proj = nn.Linear(C, cfg.kv_heads * D, bias=qkv_bias)  # K < H heads: grouped-query attention
        self.v_proj = nn.Linear(C, cfg.kv_heads * D, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=cfg.bias)
        self.o_proj.residual_scale = True  # GPT-2 init: scaled by 1/sqrt(2 * n_layer)
        # QK-norm: each head's query and key to unit RMS (times a gain) before RoPE; bounds the logits
        self.q_norm = nn.RMSNorm(D, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(D, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.resid_dropout = Dropout(cfg.dropout)
        # μP: attention logits q.k / D scaled to equal SP's q.k / sqrt(D) at the base width (attn_mult =
        # sqrt(D_base)): q is multiplied by sqrt(D_base / D), the attention kernels keep their 1/sqrt(D)
        self.q_mult = mup_attention_mult(cfg)
        # Set from outside by ring context parallel (loom.parallel.ring), None on one device: x then holds
        # some tokens of a longer sequence; context.positions(T, device) gives their places in it (T,), and
        # context.attention(q, k, v) their causal attention over the keys and values of the whole sequence.
        self.context = None

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, doc: DocMask | None = None
    ) -> torch.Tensor:
        """doc: the window's documents (data.doc_mask): attention stays within each, and with restarting
        positions RoPE turns q and k by each token's place in its document."""
        B, T, _ = x.shape
        # (B, T, C) -> (B, T, H, D); -1 lets a tensor-parallel shard hold fewer heads.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        T = q.size(1)  # x's T, unless context parallel (loom.parallel) turned the projections head-sharded
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, D), (B, K, T, D)
        if self.q_mult != 1.0:  # μP's 1/D attention (model.mup)
            q = q * self.q_mult
        if self.rope is not None and doc is not None and doc.positions is not None:
            cos, sin = rope_cos_sin_at(doc.positions, self.head_dim, self.rope)  # (B, T, D)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): the same for every head
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif self.rope is not None and self.context is not None:
            cos, sin = rope_cos_sin_at(self.context.positions(T, x.device), self.head_dim, self.rope)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif self.rope is not None and cache is not None:  # each row's positions: (T,) or (B, T)
            pos = cache.positions(T, x.device)
            cos, sin = rope_cos_sin_at(pos, self.head_dim, self.rope)
            if pos.dim() == 2:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, D): the same for every head
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        elif self.rope is not None:
            cos, sin = rope_cos_sin(0, T, self.head_dim, self.rope, x.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.context is not None:  # the K key/value heads travel; grouped-query sharing happens there
            y = self.context.attention(q, k, v)
            return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, -1)))
        mask = None
        if cache is not None:  # the cache keeps the K key/value heads, rotated (loom.model.kv_cache)
            k, v, mask = cache.store(layer, k, v)
        if k.size(1) != q.size(1):  # grouped-query: query head h reads key/value head h // (H / K)
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        if doc is not None:
            y = doc_attention(q, k, v, doc, self.dropout if self.training else 0.0)
        elif cache is None:
            y = causal_attention(q, k, v, self.dropout if self.training else 0.0)
        elif mask is None:  # prefill from position 0: ordinary causal attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # new queries see the cached keys up to their own positions
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C_local); context parallel: back to T/cp in o_proj
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    """GELU: down(gelu(up(x))), width 4C. SwiGLU: down(silu(gate(x)) * up(x)), width ~8C/3 (cfg.ffn_width)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.ffn_width
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias) if cfg.mlp == "swiglu" else None
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.down_proj.residual_scale = True
        self.dropout = Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"  # erf: ~2.5x faster on CPUs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = F.gelu(self.up_proj(x), approximate=self.approximate)
        return self.dropout(self.down_proj(h))


class LMHead(nn.Linear):
    """The output projection (B, T, C) -> (B, T, V) without bias, padding ids masked (mask_padding_).

    The vocabulary is padded to a multiple of 64 for the matmul's sake only: the model is a distribution over
    vocab_size ids, as transformers' is for the same weights. A vocabulary-parallel head (tensor parallel,
    gpt_parallel.py) sets mask_padding False and masks each rank's shard of the logits itself."""

    def __init__(self, n_embd: int, vocab_size: int, padded_vocab: int, mult: float = 1.0):
        super().__init__(n_embd, padded_vocab, bias=False)
        self.vocab_size = vocab_size
        self.mask_padding = vocab_size < padded_vocab
        self.mult = mult  # μP's output multiplier 1 / m (model.mup); 1.0 otherwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x * self.mult if self.mult != 1.0 else x)
        return mask_padding_(logits, self.vocab_size) if self.mask_padding else logits


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = norm_layer(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm_layer(cfg, cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, doc: DocMask | None = None
    ) -> torch.Tensor:
        # doc as a keyword: tensor-parallel plans describe the positional inputs (x, cache, layer)
        x = x + self.attn(autocast_input(self.ln_1(x)), cache, layer, doc=doc)
        return x + self.mlp(autocast_input(self.ln_2(x)))


class GPT(nn.Module):
    block_cls = Block  # a family on this class with another block (a plug-in) sets its own

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos == "learned" else None  # RoPE: none
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(self.make_block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = norm_layer(cfg, cfg.n_embd)
        # model.mtp_depth: one MTPModule per extra token ahead (trained only; none by default)
        self.mtp = nn.ModuleList(MTPModule(cfg, self.block_cls(cfg)) for _ in range(cfg.mtp_depth)) or None
        # padding ids masked; μP: logits times 1 / m
        self.lm_head = LMHead(cfg.n_embd, cfg.vocab_size, cfg.padded_vocab, 1.0 / cfg.mup_width_mult)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # weight tying (GPT-2)
        if cfg.doc_mask and cfg.eot_id < 0:
            raise ValueError("doc_mask needs eot_id, the end-of-text id that opens each document")
        if self.wte.weight.device.type != "meta":  # built on the meta device: initialised after sharding
            self.reset_parameters(int(torch.randint(2**62, ())))  # the seed follows torch.manual_seed

    def make_block(self, cfg: GPTConfig, layer: int) -> nn.Module:
        """Block `layer` (a family whose layers differ, e.g. MoE every k-th, chooses per layer)."""
        return self.block_cls(cfg)

    def reset_parameters(self, seed: int) -> None:
        """Every parameter to its initial values for `seed` (see init_param)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                self.init_param(name, p, seed)

    @torch.no_grad()
    def init_param(self, name: str, t: torch.Tensor, seed: int) -> None:
        """Fill t, the whole parameter `name`, with its initial values.

        GPT-2: N(0, 0.02) for embeddings and matrices (an untied head too), residual output projections scaled
        by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with depth; norm gains 1, biases 0.
        The values
        come from a generator seeded by (seed, name), so they do not depend on which other parameters exist
        or in which order they are made: a sharded or pipelined model initialises each of its pieces to the
        same weights as one process (loom.parallel builds models on the meta device and calls this per name).
        """
        if name.endswith(
            (".lora_A", ".lora_B")
        ):  # LoRA adapters (model/lora.py): their rule, the same seeding
            return init_lora_param(name, t, seed)
        if name == "lm_head.weight" and self.cfg.tie_embeddings:
            name = "wte.weight"  # tied: one tensor
        try:
            module = self.get_submodule(name.rpartition(".")[0])
        except AttributeError:  # a pipeline stage without the embedding keeps only the tied head
            module = None
        if name.endswith(".bias"):
            t.zero_()
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            t.fill_(1.0)
        else:
            std = self.init_std(name, module)
            g = torch.Generator(device=t.device).manual_seed(
                (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
            )
            t.normal_(0.0, std, generator=g)

    def init_std(self, name: str, module: nn.Module | None) -> float:
        """The standard deviation of a weight's normal init: 0.02, a residual output's scaled by depth."""
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_scale", False) else 0.02
        return std * mup_init_mult(name, self.cfg)  # μP: hidden matrices' std / sqrt(m) (1 otherwise)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last: int = 0,
    ) -> torch.Tensor:
        """Logits (B, T, V) when targets is None (padding ids at the lowest value: LMHead), else the mean
        cross-entropy over all target tokens. last > 0: logits of the last `last` positions only, (B, last, V)
        (scoring continuations: the LM head is a third of a GPT-2's FLOPs, and only the answer's rows are read)."""
        B, T = idx.shape
        end = cache.end(T) if cache is not None else T
        # learned positions have block_size slots; RoPE has none, and runs on past block_size with a cache (the
        # model was trained on block_size tokens: what it does beyond is what transformers' Llama does too)
        if end > self.cfg.block_size and (self.wpe is not None or cache is None):
            raise ValueError(f"sequence of {end} tokens exceeds block_size {self.cfg.block_size}")
        doc = self.documents(idx) if self.cfg.doc_mask and cache is None else None
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:  # learned absolute positions; RoPE turns q and k inside attention instead
            restart = doc is not None and doc.positions is not None
            if restart:
                pos = doc.positions
            else:  # (T,), or (B, T) for the rows of a running batch (RowCache)
                pos = (
                    cache.positions(T, idx.device)
                    if cache is not None
                    else torch.arange(T, device=idx.device)
                )
            x = x + self.wpe(pos)
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i) if doc is None else block(x, cache, i, doc=doc)
        if cache is not None:
            cache.advance(T)
        h = x
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, -last:] if last else x)
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        if self.mtp is not None and self.training:  # DeepSeek-V3's L + lambda / D sum_k L^k (loom.model.mtp)
            hidden = mtp_hidden(self.mtp, self.wte, h, idx, doc)
            loss = loss + self.cfg.mtp_weight * mtp_loss(
                lambda z: self.lm_head(self.ln_f(z)), hidden, targets
            )
        return loss

    def mtp_logits(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The MTP modules' predictions for self-speculative decoding (no cache): for the ids idx (B, T), a list
        of D logits (B, T-k, V), the k-th at position i predicting the token at i + k + 1 (the main head's
        logits predict i + 1). [] for a model without model.mtp_depth."""
        if self.mtp is None:
            return []
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block(x, None, i)
        return [self.lm_head(self.ln_f(h)) for h in mtp_hidden(self.mtp, self.wte, x, idx)]

    def documents(self, idx: torch.Tensor) -> DocMask:
        """The documents of the windows idx (B, T), opened by each end-of-text id (doc_mask). Generation with a
        cache attends across the whole context: a prompt is one document."""
        return build_doc_mask(idx, self.cfg.eot_id, self.cfg.doc_positions == "restart")

    def kv_cache(self, batch: int, max_len: int, rows: bool = False) -> KVCache | RowCache:
        """An empty cache for `batch` sequences of up to max_len tokens, on the parameters' device and dtype;
        rows: each sequence at its own length (RowCache: the slots of loom.engine's running batch)."""
        p = next(self.parameters())
        return (RowCache if rows else KVCache)(self.cfg, batch, max_len, p.device, p.dtype)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters counted once (a tied head is the token embedding)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(e.weight.numel() for e in (self.wte, self.wpe) if e is not None)
        return n
