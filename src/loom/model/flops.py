"""Parameter counts and training FLOPs per token.

FLOPs follow the PaLM appendix B convention (also nanoGPT's estimate_mfu): every weight matrix costs
2 FLOPs per token per parameter forward and 4 backward (6N), and attention's score and value products add
12 * n_layer * n_embd * block_size per token (counted as if not causal, as PaLM does). N counts the matrices
that are multiplied: all Linear weights including the (tied) LM head; embedding lookups cost no FLOPs.
"""

from __future__ import annotations

from loom.model.gpt import GPTConfig


def matmul_params(cfg: GPTConfig) -> int:
    C, L = cfg.n_embd, cfg.n_layer
    per_block = 4 * C * C + 2 * 4 * C * C  # q, k, v, o + MLP up and down
    return L * per_block + cfg.padded_vocab * C  # + LM head


def param_count(cfg: GPTConfig) -> int:
    """Distinct parameters (tied head counted once), matching GPT.num_params()."""
    C, L = cfg.n_embd, cfg.n_layer
    ln = 2 * C if cfg.bias else C
    per_block = 12 * C * C + 2 * ln
    if cfg.bias:
        per_block += 4 * C + 4 * C + C  # q, k, v, o biases; up bias; down bias
    return cfg.padded_vocab * C + cfg.block_size * C + L * per_block + ln


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs (forward + backward) per token."""
    T = seq_len or cfg.block_size
    return 6 * matmul_params(cfg) + 12 * cfg.n_layer * cfg.n_embd * T
