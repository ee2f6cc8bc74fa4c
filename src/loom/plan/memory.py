"""Per-GPU memory of a loom training step: model states (the ZeRO paper's stages) and what a step holds at its
peak (activations, FSDP's unsharded blocks), each term modelled on what loom's code keeps. Bytes throughout.

Model states, held between steps — Rajbhandari et al. 2020, "ZeRO", section 5: stage 1 shards the optimizer
state over the data-parallel degree, stage 2 also the gradients, stage 3 also the parameters. loom keeps fp32
parameters and fp32 gradients whatever the precision (autocast computes in 16 bits; FSDP gathers 16-bit
copies for the compute, loom.parallel.fsdp.mp_policy) and AdamW's two fp32 moments: 4 + 4 + 8 bytes a
parameter, not the paper's 2 + 2 + 12 (fp16 parameters and gradients, an fp32 master copy in the optimizer),
which has the same total and another split.

Activations — in the spirit of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", eq. 1: what one layer saves for backward, s·b·h units), but tensor by tensor as loom's Block
(model/gpt/gpt.py) saves them under autocast on a GPU, checked against the dry run (loom.dryrun, torch's memory
tracker on the real code path; tests/unit/test_plan_vs_dryrun.py). s sequence length, b micro-batch, h width,
F the MLP's hidden width, t tensor-parallel degree; e the compute dtype's bytes (2 under 16-bit autocast):
  * the two norms' inputs, as fp32 copies under autocast (CUDA's autocast runs norms in fp32) and the norms'
    statistics; on sequence shards (/t) with sequence parallel, whole on every TP rank without (RMSNorm as
    CUDA's fused kernel, torch's _fused_rms_norm, keeps it: on a CPU torch's composite RMSNorm also keeps the
    normalised tensor, one more s·b·h a norm, which is why a Llama measured on a CPU holds ~10 % more);
  * each sub-layer's input, cast once to e bytes (model.gpt.autocast_input) and read by q/k/v (gate/up):
    full-length on every TP rank (tensor parallel replicates it; sequence parallel all-gathers it and torch's
    DTensor keeps the gathered copy);
  * attention: q, k and v as the fused kernel gets them (k and v at the full head count: loom repeats grouped
    key/value heads before it), the output (also o_proj's input) and a fp32 log-sum-exp per head, all /t; RoPE's
    cos/sin tables, one copy per q and k (not per sample);
  * the MLP's hidden tensors, /t: SwiGLU's gate and up outputs, silu's output and the product; GELU's two;
  * dropout masks (m bytes an element) when dropout > 0; with eager attention the s×s scores (Korthikanti's
    5as²b at m = 1, e = 2).
A MoE layer (the moe family, model/moe/moe.py) keeps its attention's tensors as above and, in place of the MLP's,
the routed tokens' (N = s·b tokens, k = top_k, H the expert width, E experts): the k copies of each token's
hidden state the experts read and the k outputs the weighted sum reads (2·e·N·k·C), the experts' hidden tensors
as SwiGLU's (4·e·N·k·H), the router's fp32 input (4·N·C under autocast) and scores (4·N·E), the top-k
weights and the int64 indices of the regrouping, and the shared experts' SwiGLU hidden tensors. None of it is
divided by t: each tensor-parallel rank runs the MoE layer whole on the gathered sequence (model/moe_parallel).
Expert parallelism moves rows between ranks but keeps N·k of them on each on average (a balanced router).
Full recomputation keeps a block's input only (the residual stream's dtype: 16-bit when FSDP gathers 16-bit
parameters, which casts every block's input, else fp32), and backward rebuilds one block at a time.
Selective recomputation (loom.parallel.ac) keeps the outputs of the matmuls and of attention.

The head (the last stage): the final norm's input, lm_head's input (full-length under tensor parallel), the fp32
log-softmax the loss keeps (over the whole vocabulary on every TP rank when a pipeline stage returns its logits
replicated, over its shard under loss_parallel otherwise), and, at the backward's first steps, the loss's
temporaries: the gradient of the log-softmax's output and of its input (two fp32 vocabulary-sized tensors;
loss_parallel's decomposed backward also keeps the exponentials: three).
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.plan.shapes import ModelShape


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter held for parameters, gradients and optimizer state; bytes per activation element
    (the compute dtype); whether the compute runs under autocast; bytes of FSDP's gathered parameters."""

    name: str
    param: int
    grad: int
    optim: int
    act: int
    doc: str
    autocast: bool = True
    gather: int = 4  # FSDP's param_dtype (loom.parallel.fsdp.mp_policy): bf16 on GPUs when training in bf16
    gather_block: int = 0  # a block's gathered weights when other than `gather` (fp8's float8 all-gather)


PRECISIONS = {
    p.name: p
    for p in (
        Precision(
            "bf16-mixed",
            4,
            4,
            8,
            2,
            "fp32 params and grads, AdamW m, v in fp32, bf16 autocast; FSDP gathers bf16 (loom's 4+4+8)",
            gather=2,
        ),
        Precision(
            "fp8-mixed",
            4,
            4,
            8,
            2,
            "bf16-mixed with float8 matmuls (precision.fp8=tensorwise): FSDP gathers the blocks' weights in float8 "
            "(1 byte), the embeddings and the unsharded gradients in bf16; torchao keeps each matmul's high-"
            "precision input for backward, so activations are bf16-mixed's",
            gather=2,
            gather_block=1,
        ),
        Precision("fp16-mixed", 4, 4, 8, 2, "as bf16-mixed in fp16 with a loss scaler; FSDP gathers fp32"),
        Precision("fp32", 4, 4, 8, 4, "fp32 params and grads, Adam m, v in fp32 (4+4+8)", autocast=False),
        Precision(
            "bf16-pure",
            2,
            2,
            4,
            2,
            "bf16 params, grads and Adam m, v; no master copy (2+2+4)",
            autocast=False,
            gather=2,
        ),
    )
}
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "eager")


def model_state_bytes(n_params: float, prec: Precision, zero: int, dp: int) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU for Ψ = n_params held by each data-parallel rank.

    ZeRO paper section 5: stage >= 1 shards the optimizer state over dp, >= 2 the gradients, 3 the
    parameters. The 7.5B / 64-GPU example at the paper's 2+2+12: 120 GB, 31.4, 16.6, 1.88 GB for stages 0-3."""
    params = n_params * prec.param / (dp if zero >= 3 else 1)
    grads = n_params * prec.grad / (dp if zero >= 2 else 1)
    optim = n_params * prec.optim / (dp if zero >= 1 else 1)
    return params, grads, optim


@dataclass(frozen=True)
class Micro:
    """One micro-batch on one rank: s, b, the TP degree, sequence parallel, the precision, recomputation,
    attention kernel, dropout mask bytes, and the residual stream's bytes (`stream`)."""

    s: int
    b: int
    tp: int
    sp: bool
    prec: Precision
    recompute: str = "none"
    attention: str = "flash"
    mask_bytes: int = 1
    stream: int = 4

    @property
    def e(self) -> int:
        return self.prec.act

    @property
    def norm_in(self) -> int:
        """Bytes a norm keeps of its input: an fp32 copy under autocast (CUDA's fp32 policy for norms)."""
        return 4 if self.prec.autocast else self.stream

    @property
    def seq_shards(self) -> int:
        """What divides tensors on the sequence: t with sequence parallel, else 1."""
        return self.tp if self.sp else 1


def _stats(shape: ModelShape, m: Micro) -> float:
    """A norm's fp32 statistics per token: RMSNorm's rstd, LayerNorm's mean and rstd."""
    return (4 if shape.norm == "rmsnorm" else 8) * m.s * m.b


def moe_mlp_bytes(shape: ModelShape, m: Micro) -> float:
    """What a MoE layer's MLP (router, routed and shared experts) keeps for backward for one micro-batch on
    one rank, whole on every TP rank (the module's docstring)."""
    n, e, k, C = m.s * m.b, m.e, shape.top_k, shape.n_embd
    routed = 2 * e * n * k * C + 4 * e * n * k * shape.expert_width
    router = (4 * n * C if m.prec.autocast else 0) + 4 * n * shape.n_experts + (8 + e) * n * k
    indices = 3 * 8 * n * k  # the expert order, its inverse and the top-k ids (int64)
    shared = 4 * e * n * shape.n_shared * shape.expert_width
    return routed + router + indices + shared


def layer_activation_bytes(shape: ModelShape, m: Micro, moe: bool = False) -> float:
    """Bytes one block (a MoE block: `moe`) keeps for backward for one micro-batch on one rank (the module's
    docstring)."""
    h, t, sb = shape.n_embd, m.tp, m.s * m.b
    sbh, e = sb * h, m.e
    if m.recompute == "full":  # the block's input, sequence-sharded with sp
        return m.stream * sbh / m.seq_shards
    mlp_width = 0 if moe else (2 if shape.mlp == "swiglu" else 1) * shape.ffn_width
    moe_mlp = moe_mlp_bytes(shape, m) if moe else 0.0
    D, q = (
        shape.head_dim,
        sb * shape.q_dim,
    )  # q: the query's and attention output's elements (sbh unless head_size)
    rope = 8 * m.s * D if shape.pos == "rope" else 0  # cos, sin (T, D): 2 x fp32, or 4 x 16-bit casts
    drop = 2 * m.mask_bytes * sbh / m.seq_shards if shape.dropout > 0 else 0
    if m.recompute == "selective":  # matmul and attention outputs; the input for the recomputation
        colwise = e * sb * (shape.q_dim + 2 * shape.kv_dim + mlp_width) / t
        rowwise = (
            (1 if moe else 2) * e * sbh
        )  # o_proj's and down_proj's outputs: whole (partial sums under TP)
        attn = e * q / t + 4 * shape.n_head * sb / t
        # a MoE layer's MLP counted as without recomputation: an upper bound (the policy saves matmuls)
        return m.stream * sbh / m.seq_shards + colwise + rowwise + attn + rope + moe_mlp
    norms = 2 * (m.norm_in * sbh + _stats(shape, m)) / m.seq_shards
    inputs = 2 * e * sbh  # attention's and the MLP's input, full-length on every TP rank
    qk_norm = (
        (m.norm_in * sb * (shape.q_dim + shape.kv_dim) + 8 * sb * shape.n_head) / t if shape.qk_norm else 0
    )
    attention = 4 * e * q / t  # q, k, v (all heads), output
    if m.attention == "eager" and m.recompute == "none":  # scores, and with dropout their mask and result
        attention += shape.n_head * m.s * sb * (e + ((m.mask_bytes + e) if shape.dropout > 0 else 0)) / t
    else:  # the fused kernel's fp32 log-sum-exp per head and token
        attention += 4 * shape.n_head * sb / t
    hidden = moe_mlp if moe else (4 if shape.mlp == "swiglu" else 2) * e * sb * shape.ffn_width / t
    return norms + inputs + qk_norm + attention + hidden + rope + drop


def head_vocab(shape: ModelShape, tp: int, replicated: bool) -> int:
    """The vocabulary one rank's loss runs over: its shard under loss_parallel, all of it when replicated."""
    return shape.padded_vocab if replicated or tp == 1 else shape.padded_vocab // tp


def head_activation_bytes(shape: ModelShape, m: Micro, replicated: bool = False) -> float:
    """The last stage's head for one micro-batch: the final norm's input and statistics, lm_head's input
    (full-length under TP), the targets and the fp32 log-softmax the loss keeps."""
    sbh = m.s * m.b * shape.n_embd
    norm = (m.norm_in * sbh + _stats(shape, m)) / m.seq_shards
    targets = 8 * m.s * m.b  # int64, kept by the loss
    return norm + m.e * sbh + targets + 4 * m.s * m.b * head_vocab(shape, m.tp, replicated)


def loss_backward_bytes(shape: ModelShape, m: Micro, replicated: bool = False) -> float:
    """The loss's backward temporaries, its peak: two fp32 vocabulary-sized gradients (three under
    loss_parallel, whose decomposed log-softmax backward keeps the exponentials too)."""
    parallel = m.tp > 1 and not replicated
    return (3 if parallel else 2) * 4 * m.s * m.b * head_vocab(shape, m.tp, replicated)


def embed_activation_bytes(shape: ModelShape, m: Micro) -> float:
    """First stage: token ids (int64) and, with dropout, the embedding dropout mask."""
    sb = m.s * m.b
    return 8 * sb + (m.mask_bytes * sb * shape.n_embd / m.seq_shards if shape.dropout > 0 else 0)


# LoRA / QLoRA (finetune.lora_rank, finetune.quantize_base, optim.state_dtype, optim.offload) --------------------
NF4_BYTES = (
    0.5 + 1 / 64 + 4 / (64 * 256)
)  # 4-bit codes, an int8 scale per 64, an fp32 factor per 16,384: 4.127 bits
STATE_BYTES = {
    "": 8.0,
    "int8": 2 + 2 * 4 / 256,
    "int4": 1 + 2 * 4 / 128,
}  # AdamW's m and v (+ fp32 block scales)


@dataclass(frozen=True)
class Finetune:
    """A LoRA run's model states: adapters of `rank` on every linear of the blocks (all-linear: QLoRA's choice)
    over a frozen base, in fp32 or NF4 (loom.model.nf4); AdamW's moments of the adapters in fp32 or torchao's
    int8 / int4 (optim.state_dtype), on the device or the host (optim.offload=cpu)."""

    rank: int
    quantize: str = "none"  # none | nf4
    state_dtype: str = ""  # "" (fp32) | int8 | int4
    offload: bool = False

    def block_linears(self, shape) -> list[tuple[int, int]]:
        """(in, out) of each linear of a dense block (as model/gpt/gpt.py: q, k, v, o, then the MLP's)."""
        C, F = shape.n_embd, shape.ffn_width
        attn = [(C, shape.q_dim), (C, shape.kv_dim), (C, shape.kv_dim), (shape.q_dim, C)]
        mlp = [(C, F), (C, F), (F, C)] if shape.mlp == "swiglu" else [(C, F), (F, C)]
        return attn + mlp

    def adapter_params(self, shape, blocks: int) -> float:
        """rank x (in + out) per adapted linear."""
        return blocks * self.rank * sum(i + o for i, o in self.block_linears(shape))

    def base_linear_params(self, shape, blocks: int) -> float:
        return blocks * sum(i * o for i, o in self.block_linears(shape))


def finetune_state_bytes(
    shape, params: float, blocks: int, ft: Finetune
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer, host) bytes of a LoRA run on one GPU holding `params` base parameters in
    `blocks` blocks: the base's linears at 4 bytes (fp32, loom's one-process LoRA) or NF4's 0.516, the rest of
    the base (embeddings, norms, head) at 4; the adapters' fp32 values and gradients; AdamW's two moments of the
    adapters at 8, 2.03 (int8) or 1.06 (int4) bytes, or none on the device with offload (the host then holds
    them and an fp32 copy of the adapters: 12 bytes each)."""
    linears = ft.base_linear_params(shape, blocks)
    adapters = ft.adapter_params(shape, blocks)
    base = linears * (NF4_BYTES if ft.quantize == "nf4" else 4.0) + (params - linears) * 4.0
    optim = 0.0 if ft.offload else adapters * STATE_BYTES[ft.state_dtype]
    host = adapters * 12.0 if ft.offload else 0.0
    return base + 4.0 * adapters, 4.0 * adapters, optim, host
