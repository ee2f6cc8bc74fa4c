"""Parameter counts and training FLOPs per token.

FLOPs follow the PaLM appendix B convention (also nanoGPT's estimate_mfu): every weight matrix costs
2 FLOPs per token per parameter forward and 4 backward (6N), and attention's score and value products add
12 * n_layer * n_embd * block_size per token (counted as if not causal, as PaLM does). N counts the matrices
that are multiplied: all Linear weights including the LM head (tied or not); embedding lookups cost no FLOPs.
Grouped-query attention makes the key and value projections K/H as wide; SwiGLU has three MLP matrices of
width cfg.ffn_width; the attention products are the same whatever K (each query head reads a whole key).
"""

from __future__ import annotations

from loom.model.gpt.gpt import GPTConfig


def _block_matrices(cfg: GPTConfig) -> int:
    C, kv, q = cfg.n_embd, cfg.kv_heads * cfg.head_dim, cfg.n_head * cfg.head_dim
    attn = 2 * C * q + 2 * C * kv  # q and o (C x H*D, H*D = C unless model.head_size), k and v (C x K*D)
    mlp = (3 if cfg.mlp == "swiglu" else 2) * C * cfg.ffn_width
    return attn + mlp


def _moe_extra(cfg, active: bool) -> int:
    """A mixture of experts' matrices beyond a dense model's, summed over its MoE layers (loom.model.moe):
    each MoE layer has a router (C x E) and E routed experts (k of them active per token) plus the shared
    ones, in place of the dense MLP."""
    if not getattr(cfg, "n_experts", 0):
        return 0
    C, H = cfg.n_embd, cfg.expert_width
    experts = (cfg.top_k if active else cfg.n_experts) + cfg.n_shared
    per_layer = (
        C * cfg.n_experts + 3 * C * H * experts - (3 if cfg.mlp == "swiglu" else 2) * C * cfg.ffn_width
    )
    return per_layer * len(cfg.moe_layers)


def _moe_biases(cfg) -> int:
    """With bias=true, a MoE layer's biases beyond a dense model's: the dense MLP's are gone (routed experts and
    router have none), the shared experts' SwiGLU (gate and up of n_shared x the expert width, down) has its own."""
    if not getattr(cfg, "n_experts", 0) or not cfg.bias:
        return 0
    dense = (2 if cfg.mlp == "swiglu" else 1) * cfg.ffn_width + cfg.n_embd
    shared = 2 * cfg.n_shared * cfg.expert_width + cfg.n_embd if cfg.n_shared else 0
    return (shared - dense) * len(cfg.moe_layers)


def _mtp_depth(cfg) -> int:
    return getattr(cfg, "mtp_depth", 0) or 0


def matmul_params(cfg: GPTConfig) -> int:
    """The matrices a token is multiplied by (a MoE's active experts only). Training with model.mtp_depth=D
    adds, per module, its 2C -> C projection, its block and the shared head once more (loom.model.mtp), counted
    over all T positions of a window although module k runs on T - k of them (as attention is counted as if
    not causal); evaluation and generation do not run the modules, so their FLOPs are the main model's
    (`matmul_params(dataclasses.replace(cfg, mtp_depth=0))`)."""
    head = cfg.padded_vocab * cfg.n_embd
    mtp = _mtp_depth(cfg) * (2 * cfg.n_embd * cfg.n_embd + _block_matrices(cfg) + head)
    return cfg.n_layer * _block_matrices(cfg) + head + _moe_extra(cfg, True) + mtp


def param_count(cfg: GPTConfig) -> int:
    """Distinct parameters (a tied head counted once), matching GPT.num_params() (MTP modules included)."""
    C, L = cfg.n_embd, cfg.n_layer
    norm = 2 * C if cfg.bias and cfg.norm == "layernorm" else C  # RMSNorm has no bias
    embeddings = cfg.padded_vocab * C * (1 if cfg.tie_embeddings else 2)
    if cfg.pos == "learned":
        embeddings += cfg.block_size * C
    mtp = _mtp_depth(cfg) * (_block_params(cfg) + 2 * C + 2 * C * C)  # two RMSNorms and M_k (2C -> C) each
    return embeddings + L * _block_params(cfg) + norm + _moe_extra(cfg, False) + _moe_biases(cfg) + mtp


def _block_params(cfg: GPTConfig) -> int:
    """One dense block's parameters: matrices, norms, q/k norms, biases."""
    C, kv, F = cfg.n_embd, cfg.kv_heads * cfg.head_dim, cfg.ffn_width
    norm = 2 * C if cfg.bias and cfg.norm == "layernorm" else C  # RMSNorm has no bias
    per_block = _block_matrices(cfg) + 2 * norm
    if cfg.qk_norm:
        per_block += 2 * cfg.head_dim
    if cfg.bias:
        per_block += cfg.n_head * cfg.head_dim + C + 2 * kv  # q, o; k, v
        per_block += (2 if cfg.mlp == "swiglu" else 1) * F + C  # gate and up, or up; down
    elif cfg.qkv_bias:
        per_block += cfg.n_head * cfg.head_dim + 2 * kv  # q; k, v
    return per_block


def active_param_count(cfg: GPTConfig) -> int:
    """Parameters one token passes through: a MoE's idle routed experts left out (dense: param_count)."""
    return param_count(cfg) - _moe_extra(cfg, False) + _moe_extra(cfg, True)


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs (forward + backward) per token, the MTP modules' included (model.mtp_depth: each runs one
    more block's attention)."""
    T = seq_len or cfg.block_size
    return 6 * matmul_params(cfg) + 12 * (cfg.n_layer + _mtp_depth(cfg)) * cfg.n_head * cfg.head_dim * T
