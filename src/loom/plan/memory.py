"""Per-GPU memory: model states (ZeRO paper) and activations (Korthikanti et al. 2022). Bytes throughout.

Model states — Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3.1: mixed-precision Adam holds Ψ fp16 parameters (2Ψ), Ψ fp16 gradients (2Ψ) and
K·Ψ of optimizer state, K = 12 (fp32 master weights, momentum, variance): (2 + 2 + K)·Ψ in all. Section 5:
ZeRO stage 1 (P_os) divides the K·Ψ term by the data-parallel degree N_d, stage 2 (P_os+g) also the
gradients, stage 3 (P_os+g+p) also the parameters: 2Ψ + 2Ψ + KΨ/N_d, 2Ψ + (2+K)Ψ/N_d, (2+2+K)Ψ/N_d.

Activations — Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4: one transformer layer with 16-bit activations, s sequence length, b micro-batch, h width,
a heads stores s·b·h·(34 + 5·a·s/h) bytes (eq. 1), of which
  * 32·s·b·h: sixteen s·b·h tensors of 2 bytes — LayerNorm inputs (2), q/k/v projection input, Q, K, V,
    attention-output projection input, MLP input, GELU input (4·h wide) and GELU output (4·h wide);
  * 2·s·b·h: two 1-byte dropout masks (after the attention projection and after the MLP);
  * 5·a·s²·b: softmax output (2 bytes), its dropout mask (1 byte), the dropped-out scores (2 bytes).
With tensor parallelism t and sequence parallelism everything is split t ways (eq. 6, s·b·h/t·(34 +
5as/h)); selective recomputation drops the 5as²b term (34·s·b·h/t, eq. 7); full recomputation keeps
only each layer's input, 2·s·b·h/t (section 5). The head adds 4·s·b·h/t·(1 + v/h) on the last stage
(LayerNorm input and output, fp32 logits for the loss; section 4.3).

loom's layer differs from eq. 1 in ways `layer_activation_bytes` models (checked against a measured run
in tests/unit/test_plan.py): activations are e bytes (e = 4 in fp32 training, 2 with 16-bit autocast);
dropout masks exist only when dropout > 0; and F.scaled_dot_product_attention's fused (flash) kernels
store no s×s matrices — only the output, which is the projection input already counted, and a fp32
log-sum-exp per head and token — so with attention="flash" the 5as²b term is 4·a·s·b, and selective
recomputation is the same as none. LayerNorm keeps a fp32 mean and reciprocal std per token (8·s·b).
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.plan.shapes import ModelShape


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for parameters, gradients and optimizer state (K), and per activation element."""

    name: str
    param: int
    grad: int
    optim: int
    act: int
    doc: str


PRECISIONS = {
    p.name: p
    for p in (
        Precision(
            "bf16-mixed", 2, 2, 12, 2, "16-bit params and grads, fp32 master + Adam m, v (ZeRO's 2+2+12)"
        ),
        Precision("fp16-mixed", 2, 2, 12, 2, "as bf16-mixed, with a loss scaler (a few bytes)"),
        Precision("fp32", 4, 4, 8, 4, "fp32 params and grads, Adam m, v in fp32 (4+4+8)"),
        Precision("bf16-pure", 2, 2, 4, 2, "bf16 params, grads and Adam m, v; no master copy (2+2+4)"),
    )
}
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "eager")


def model_state_bytes(n_params: float, prec: Precision, zero: int, dp: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU for Ψ = n_params held by each data-parallel rank.

    ZeRO paper section 5: stage >= 1 shards the optimizer state over dp, >= 2 the gradients, 3 the
    parameters. The 7.5B / 64-GPU example: 120 GB, 31.4, 16.6, 1.88 GB for stages 0-3.
    """
    params = n_params * prec.param / (dp if zero >= 3 else 1)
    grads = n_params * prec.grad / (dp if zero >= 2 else 1)
    optim = n_params * prec.optim / (dp if zero >= 1 else 1)
    return params, grads, optim


def layer_activation_bytes(
    shape: ModelShape,
    s: int,
    b: int,
    tp: int,
    act_bytes: int,
    recompute: str,
    attention: str,
    mask_bytes: int = 1,
) -> float:
    """Bytes one layer keeps for backward for one micro-batch (sequence parallel when tp > 1: all / tp).

    Korthikanti eq. 1 generalised: sbh·(16·e + 2·m·[dropout]) + attention core (16: shape.act_units for
    gpt2's block; grouped-query attention and SwiGLU change it), where the core is
    a·s²·b·(e + [dropout]·(m + e)) for eager attention (= 5as²b at e = 2, m = 1 with dropout) and a
    fp32 log-sum-exp, 4·a·s·b, for fused attention. Full recomputation keeps the layer input, e·s·b·h.
    m is a dropout mask's bytes per element: 1 for CUDA's boolean masks; on CPU, dropout multiplies by a
    mask of the activation dtype (m = e).
    """
    h, a = shape.n_embd, shape.n_head
    sbh = s * b * h
    drop = shape.dropout > 0
    if recompute == "full":
        return act_bytes * sbh / tp
    # 16 units for gpt2's block (shape.act_units: grouped-query and SwiGLU widths), + two norms' statistics
    dense = sbh * (shape.act_units * act_bytes + (2 * mask_bytes if drop else 0)) + 2 * 8 * s * b
    if attention == "eager" and recompute == "none":
        core = a * s * s * b * (act_bytes + ((mask_bytes + act_bytes) if drop else 0))
    else:  # fused kernel, or selective recomputation of the attention core
        core = 4 * a * s * b
    return (dense + core) / tp


def head_activation_bytes(shape: ModelShape, s: int, b: int, tp: int, act_bytes: int) -> float:
    """Last stage: final LayerNorm input and output (2·e·sbh) and the fp32 log-softmax the loss keeps
    (4·s·b·V; vocabulary-parallel under TP) — Korthikanti section 4.3's 4sbh(1 + v/h) at e = 2 — plus
    the LayerNorm's mean and rstd and the int64 targets (16·s·b)."""
    return (2 * act_bytes * s * b * shape.n_embd + 16 * s * b + 4 * s * b * shape.padded_vocab) / tp


def embed_activation_bytes(shape: ModelShape, s: int, b: int, tp: int, mask_bytes: int = 1) -> float:
    """First stage: token ids (int64) and, with dropout, the embedding dropout mask."""
    return 8 * s * b + (mask_bytes * s * b * shape.n_embd / tp if shape.dropout > 0 else 0)


def model_activation_bytes(
    shape: ModelShape, s: int, b: int, act_bytes: int, attention: str = "flash", mask_bytes: int = 1
) -> float:
    """A whole single-device model for one forward (tp = pp = 1, no recomputation): what the test measures."""
    per_layer = layer_activation_bytes(shape, s, b, 1, act_bytes, "none", attention, mask_bytes)
    head = head_activation_bytes(shape, s, b, 1, act_bytes)
    return shape.n_layer * per_layer + head + embed_activation_bytes(shape, s, b, 1, mask_bytes)
