"""What one rank holds at its step's peak, stage by stage: model states, activations and FSDP's (or DDP's)
buffers, at each moment where a loom step can peak (the moments loom.dryrun marks as phases). Bytes throughout.

Moments (the largest wins):
  * the head's backward: every block's activations and the loss's temporaries held (with a pipeline: the
    micro-batches in flight, FSDP's accumulated gradients of the stage);
  * with full recomputation, the last block's backward: the blocks' inputs, one block rebuilt and its
    backward's temporaries;
  * the end of backward under FSDP: the root (embeddings, final norm, head) reduce-scatters its gradients.
Buffers: FSDP2 all-gathers a block's 16-bit parameters for its forward and backward and prefetches the next
(loom.parallel.fsdp); the root's stay gathered from forward to the end of backward; zero2 keeps every block's
gathered from its forward to its backward; data-parallel replicas of tensor/pipeline layouts (FSDP with one
shard) keep them all. At the root's reduce-scatter: its gathered parameters and gradients, the fp32
reduce-scatter input, the last block's (FSDP frees it at the next reduce), and the embedding's gradient built in
fp32 then cast (torch's embedding backward for 16-bit weights). Under torch's pipelining FSDP neither reshards
after backward nor reduce-scatters before the last micro-batch: each block's gradient accumulates unsharded
in fp32 from the stage's first backward. DDP (pure data parallel) keeps a bucket copy of every gradient.

Mixtures of experts with expert parallelism (loom.parallel.expert): a MoE layer's routed experts are split over
ep of the data-parallel x cp ranks (E / ep whole experts on each, not split by tensor parallelism) and their
states sharded over the remaining dp·cp/ep ranks where the others shard over dp·cp (FSDP's `efsdp`); DDP
leaves them out of its buckets (their gradients are all-reduced apart). Everything else is as a dense model's.
The gathered expert weights are 16-bit under fp8 too (torchao converts nn.Linear, not the grouped experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loom.plan.memory import (
    Finetune,
    Micro,
    Precision,
    embed_activation_bytes,
    finetune_state_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    loss_backward_bytes,
    model_state_bytes,
)
from loom.plan.shapes import ModelShape


@dataclass(frozen=True)
class Stage:
    """One pipeline rank's part: its blocks, whether it holds the embeddings and the head, the micro-batches it
    keeps in flight, and its local parameters (TP shards, before data-parallel sharding)."""

    blocks: int
    first: bool
    last: bool
    in_flight: int
    block_params: float  # one (dense) block's
    embed_params: float  # the token (and position) embedding's, when first
    head_params: float  # the final norm's and the head's, when last
    moe_blocks: int = 0  # of `blocks`, the MoE ones
    moe_block_params: float = 0.0  # a MoE block's without its routed experts
    expert_block: float = 0.0  # a MoE block's routed experts on this rank: E / ep of them

    @property
    def expert_params(self) -> float:
        """The stage's routed experts on this rank (sharded over dp·cp/ep, not dp·cp)."""
        return self.moe_blocks * self.expert_block

    @property
    def blocks_params(self) -> float:
        """Every block's, experts included."""
        dense = (self.blocks - self.moe_blocks) * self.block_params
        return dense + self.moe_blocks * self.moe_block_params + self.expert_params

    @property
    def largest_block(self) -> float:
        """The largest block's parameters on this rank (a MoE block's with its experts)."""
        dense = self.block_params if self.blocks > self.moe_blocks else 0.0
        return max(dense, self.moe_block_params + self.expert_block if self.moe_blocks else 0.0)

    def gathered(self, gb: float, g: float) -> tuple[float, float]:
        """(every block, the largest block) as FSDP gathers them: gb bytes a weight, g for the experts."""
        dense = gb * self.block_params if self.blocks > self.moe_blocks else 0.0
        moe = gb * self.moe_block_params + g * self.expert_block if self.moe_blocks else 0.0
        every = gb * (self.blocks_params - self.expert_params) + g * self.expert_params
        return every, max(dense, moe)

    @property
    def root_params(self) -> float:
        """FSDP's root unit: what is not a block."""
        return (self.embed_params if self.first else 0.0) + (self.head_params if self.last else 0.0)

    @property
    def params(self) -> float:
        return self.blocks_params + self.root_params


def stage_layers(n_layer: int, n_stages: int) -> list[int]:
    """Blocks per stage as loom's families cut them (model/gpt_parallel.stage_layers): balanced, the extra ones
    to the middle stages (the first and last also run the embeddings and the head)."""
    base, extra = divmod(n_layer, n_stages)
    sizes = [base] * n_stages
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(s - (n_stages - 1) / 2)))
    for s in order[:extra]:
        sizes[s] += 1
    return sizes


def stages(
    shape: ModelShape, tp: int, pp: int, n_micro: int, gpipe: bool = False, ep: int = 1
) -> list[Stage]:
    """The first, the last and the fullest middle pipeline rank (one stage when pp = 1). 1F1B keeps pp - r
    micro-batches in flight on pipeline rank r (GPipe all of them)."""
    sizes = stage_layers(shape.n_layer, pp)
    starts = [sum(sizes[:r]) for r in range(pp)]
    n_moe = [
        shape.moe_layers_below(a + n) - shape.moe_layers_below(a) for a, n in zip(starts, sizes, strict=True)
    ]
    layer = (shape.layer_params - 2 * shape.ln_params) / tp + 2 * shape.ln_params
    whole = shape.moe_block_params - shape.attn_params() - shape.qk_params()  # norms, router, shared experts
    moe_layer = (shape.attn_params() + shape.qk_params()) / tp + whole
    embed = shape.padded_vocab * shape.n_embd / tp + shape.embed_params - shape.padded_vocab * shape.n_embd
    head_matrix = shape.head_params / tp if pp > 1 or not shape.tie_embeddings else 0.0
    head = shape.ln_params + head_matrix
    scale = shape.param_count() / shape.counted_params()  # --params N with an assumed shape
    picks = [0, pp - 1] + ([max(range(1, pp - 1), key=lambda r: (sizes[r], n_moe[r]))] if pp > 2 else [])
    out = []
    for r in dict.fromkeys(picks):
        flight = n_micro if gpipe else min(n_micro, pp - r)
        out.append(
            Stage(
                sizes[r],
                r == 0,
                r == pp - 1,
                flight,
                layer * scale,
                embed * scale,
                head * scale,
                n_moe[r],
                moe_layer * scale,
                shape.routed_params / ep * scale,
            )
        )
    return out


@dataclass(frozen=True)
class Layout:
    """What the peak depends on besides the model: degrees, ZeRO stage, micro-batches, recomputation."""

    dp: int
    tp: int
    pp: int
    zero: int
    replicate: int
    micro_batch: int
    n_micro: int
    recompute: str
    sp: bool = True
    cp: int = 1  # context parallel: each rank holds s / cp tokens of a sequence (the caller passes s / cp)
    ep: int = 1  # expert parallel: a MoE layer's routed experts split over ep of the dp x cp ranks
    offload: bool = False  # train.activation_offload: saved activations in host memory (_moments)
    ft: Finetune | None = None  # a LoRA / QLoRA run's model states (one GPU: loom.plan.memory.Finetune)

    @property
    def shard(self) -> int:
        """The ranks FSDP shards over: a replica's data-parallel ranks and their cp ranks (dp_shard x cp)."""
        return self.dp // self.replicate * self.cp

    @property
    def fsdp(self) -> bool:
        """loom applies FSDP2: zero2/zero3, and the data-parallel (or cp) replicas of tensor/pipeline layouts."""
        return self.zero >= 2 or (self.dp * self.cp > 1 and (self.tp > 1 or self.pp > 1))

    @property
    def cp_sharded(self) -> bool:
        """ddp with tp/pp and cp: FSDP shards over the cp ranks (stage 3, the dp ranks its replicas) and, being
        sharded, reduce-scatters every micro-step as zero3 does."""
        return self.zero == 0 and self.fsdp and self.cp > 1

    @property
    def stage(self) -> int:
        """The ZeRO stage loom really runs (3 for cp_sharded)."""
        return 3 if self.cp_sharded else self.zero

    @property
    def stage_shard(self) -> int:
        """The ranks the stage shards over (the cp ranks for cp_sharded)."""
        return self.cp if self.cp_sharded else self.shard


def stage_memory(
    shape: ModelShape, prec: Precision, s: int, attention: str, lay: Layout, st: Stage
) -> dict[str, float]:
    """params, grads, optim (held), activations and buffers at the stage's peak, the moment it is at."""
    fsdp = lay.fsdp
    g = prec.gather if fsdp else 4
    gb = (prec.gather_block or g) if fsdp else 4  # a block's gathered weights (float8 under fp8)
    stream = g if fsdp else (4 if prec.autocast else prec.act)
    m = Micro(s, lay.micro_batch, lay.tp, lay.sp and lay.tp > 1, prec, lay.recompute, attention, 1, stream)
    # loom's zero2 is FSDP without the reshard after forward: its parameters rest sharded too, as stage 3's
    # (whole from a block's forward to its backward: buffers)
    zero = 3 if lay.stage == 2 else lay.stage
    shard = lay.stage_shard if zero >= 2 else lay.dp * lay.cp
    p, gr, o = model_state_bytes(st.params - st.expert_params, prec, zero, shard)
    experts = model_state_bytes(st.expert_params, prec, zero, max(1, shard // lay.ep))
    p, gr, o = p + experts[0], gr + experts[1], o + experts[2]
    if lay.ft is not None:  # LoRA / QLoRA on one GPU: a frozen base, trained adapters
        p, gr, o, ft_host = finetune_state_bytes(shape, st.params, st.blocks, lay.ft)
    moments = _moments(shape, m, lay, st, g, gb)
    name, (act, buf) = max(moments.items(), key=lambda kv: sum(kv[1]))
    # Gradients exist at the peak only when an earlier micro-step made them: accumulation without a pipeline
    # (a pipeline's FSDP stages reduce theirs at the end; the first micro-step's peak comes before any).
    held = gr if lay.n_micro > 1 and (lay.pp == 1 or not lay.fsdp) else 0.0
    return {
        "params": p,
        "grads": gr,
        "optim": o,
        "activations": act,
        "buffers": buf,
        "total": p + held + o + act + buf,
        "moment": name,
        "expert_states": sum(experts),
        **(
            {"host": _offloaded(shape, m, lay, st)} if lay.offload else {}
        ),  # host memory, train.activation_offload
        **({"optim_host": ft_host} if lay.ft is not None and lay.ft.offload else {}),  # optim.offload=cpu
    }


def _moments(
    shape: ModelShape, m: Micro, lay: Layout, st: Stage, g: int, gb: int
) -> dict[str, tuple[float, float]]:
    """{moment: (activations, buffers)} for the stage."""
    sbh = m.s * m.b * shape.n_embd
    replicated = lay.pp > 1  # a pipeline's last stage returns its logits whole on every TP rank
    batch = (
        8 * m.s * m.b * lay.n_micro * ((1 if st.first else 0) + (1 if st.last else 0))
    )  # int64 ids, targets
    per_micro = _saved(shape, m, st)
    hidden = m.stream * sbh / m.seq_shards  # a pipeline stage's output or received input, per micro-batch
    fixed = batch + _weight_casts(shape, m, st, g, lay.ft)
    # train.activation_offload: what autograd saves is in host memory, but for the block whose backward runs
    # (copied back for it); autocast's weight casts stay counted (its cache holds them through the forward)
    block_back = _largest_block(shape, m, st) if lay.offload else 0.0
    if lay.offload:
        per_micro = 0.0
    if lay.pp > 1:
        per_micro += 0 if st.last else hidden  # kept until its backward (the schedule's, not autograd's)
        fixed += lay.n_micro * hidden * ((0 if st.first else 1) + (0 if st.last else 1))  # receive buffers
    head = 0.0
    if st.last:
        head = head_activation_bytes(shape, m, replicated) + loss_backward_bytes(shape, m, replicated)
        if replicated:  # the stage's output, the gathered logits, kept until its backward
            head += m.e * m.s * m.b * shape.padded_vocab
    vocab_rows = shape.padded_vocab * shape.n_embd if lay.tp > 1 else st.embed_params
    if lay.pp > 1:
        gathered, acc = _pipeline_buffers(lay, st, g, gb, vocab_rows)
        # 1F1B: its first backward with w micro-batches in flight and nothing accumulated yet; from its second
        # on, the gradients accumulated and again w in flight (when a forward came between: m > w)
        w = st.in_flight
        again = w if lay.n_micro > w else w - 1
        return {
            "warm-up's end": (w * per_micro + max(head, block_back) + fixed, gathered),
            "1F1B": (again * per_micro + max(head, block_back) + fixed, gathered + acc),
        }
    buf = _buffers(lay, st, g, gb, vocab_rows)
    moments = {"head backward": (per_micro + head + fixed, buf["forward"])}
    rebuilt = 0.0
    if lay.recompute == "full":  # a block rebuilt, and its backward's gradients of the MLP's hidden tensors
        whole = replace(m, recompute="none")
        dense = layer_activation_bytes(shape, whole) + 3 * m.e * m.s * m.b * shape.ffn_width / m.tp
        moe = (
            layer_activation_bytes(shape, whole, moe=True)
            + 3 * m.e * m.s * m.b * shape.top_k * shape.expert_width
        )
        rebuilt = max(dense if st.blocks > st.moe_blocks else 0.0, moe if st.moe_blocks else 0.0)
    moments["blocks' backward"] = (per_micro + block_back + rebuilt + fixed, buf["backward"])
    if "end" in buf:
        shard = g * st.embed_params if lay.tp > 1 and st.first else 0.0  # the embedding's rows, reduced
        moments["end of backward"] = (batch + shard, buf["end"])
    return moments


def _saved(shape: ModelShape, m: Micro, st: Stage) -> float:
    """What autograd saves for one micro-batch's backward on the stage: its blocks' and the embedding's."""
    per_micro = (st.blocks - st.moe_blocks) * layer_activation_bytes(shape, m)
    per_micro += st.moe_blocks * layer_activation_bytes(shape, m, moe=True)
    return per_micro + (embed_activation_bytes(shape, m) if st.first else 0.0)


def _largest_block(shape: ModelShape, m: Micro, st: Stage) -> float:
    """One block's saved activations, the largest kind the stage has (dense or MoE)."""
    dense = layer_activation_bytes(shape, m) if st.blocks > st.moe_blocks else 0.0
    return max(dense, layer_activation_bytes(shape, m, moe=True) if st.moe_blocks else 0.0)


def _offloaded(shape: ModelShape, m: Micro, lay: Layout, st: Stage) -> float:
    """Host memory train.activation_offload needs at most: what autograd saves for the micro-batches in
    flight (one without a pipeline: accumulation frees a micro-batch's copies at its backward) and the head's."""
    flight = st.in_flight if lay.pp > 1 else 1
    head = head_activation_bytes(shape, m, lay.pp > 1) if st.last else 0.0
    return flight * (_saved(shape, m, st) + head)


def _weight_casts(shape: ModelShape, m: Micro, st: Stage, g: int, ft: Finetune | None = None) -> float:
    """Autocast casts each fp32 weight a matmul reads to 16 bits, and the matmul keeps the copy for its
    backward: one copy of the stage's matrices, unless FSDP gathers them in 16 bits already. An NF4 base
    (QLoRA) keeps its 4-bit weight for backward (torchao's linear_nf4) and dequantizes one linear at a time:
    the adapters' and the head's casts, and the largest linear's dequantized copy."""
    if not m.prec.autocast or g != 4:
        return 0.0
    norms = st.blocks * 2 * shape.ln_params + (shape.ln_params if st.last else 0.0)
    matrices = st.params - (st.embed_params if st.first else 0.0) - norms
    if ft is not None:
        matrices += ft.adapter_params(shape, st.blocks)
        if ft.quantize == "nf4":
            largest = max(i * o for i, o in ft.block_linears(shape))
            matrices += largest - ft.base_linear_params(shape, st.blocks)
    return m.e * matrices


def _pipeline_buffers(lay: Layout, st: Stage, g: int, gb: int, vocab_rows: float) -> tuple[float, float]:
    """(gathered, accumulated) of a pipeline stage: torch's pipelining keeps FSDP from reducing before the last
    micro-batch, so each block's gradient accumulates unsharded in fp32 from the stage's first backward (the
    embedding's whole-vocabulary one under TP); a non-last stage holds the embedding, a block and the next
    gathered. Without FSDP (one data-parallel rank) nothing."""
    if not lay.fsdp:
        return 0.0, 0.0
    acc = 4 * (st.blocks_params + (vocab_rows if st.first else 0.0))
    acc += 4 * st.head_params if st.last else 0.0
    every, largest = st.gathered(gb, g)
    if lay.stage != 3 or lay.stage_shard == 1:
        return g * st.root_params + every, acc
    return (0.0 if st.last else g * (st.embed_params if st.first else 0.0) + 2 * largest), acc


def _buffers(lay: Layout, st: Stage, g: int, gb: int, vocab_rows: float) -> dict[str, float]:
    """FSDP's gathered parameters and unsharded gradients, or DDP's buckets, by moment. `vocab_rows`: the
    embedding's gradient on a rank (the whole vocabulary's under tensor parallel: DTensor's embedding backward
    builds it whole on every TP rank before reducing it to the rank's rows)."""
    every, largest = st.gathered(gb, g)
    if not lay.fsdp:  # with expert parallelism DDP leaves the experts out of its buckets
        ddp = 4.0 * (st.params - (st.expert_params if lay.ep > 1 else 0.0)) if lay.dp * lay.cp > 1 else 0.0
        return {"forward": ddp, "backward": ddp}
    # zero2, or replicas: every block gathered from forward to backward
    if lay.stage != 3 or lay.stage_shard == 1:
        held = g * st.root_params + every
        if lay.zero < 2 and lay.n_micro > 1:  # replicas skip the sync between micro-steps: fp32 gradients
            held += 4 * st.params
        return {"forward": held, "backward": held}
    root, block = st.root_params, st.largest_block
    head = st.head_params if st.last else 0.0
    # the root's gradients complete (the embedding's whole-vocabulary one), then its fp32 reduce-scatter input;
    # the last block's reduce-scatter input is held until then
    grads_done = g * root + g * (head + vocab_rows) + 4 * block
    reducing = g * root + 4 * root + 4 * block  # FSDP reshards the root before its reduce-scatter
    # the top block's reduce-scatter: the block gathered, its unsharded gradients and their fp32 reduce-scatter
    # input
    backward = g * root + largest + g * block + 4 * block
    return {"forward": g * root + largest, "backward": backward, "end": max(grads_done, reducing)}


def peak_memory(shape: ModelShape, prec: Precision, s: int, attention: str, lay: Layout) -> dict:
    """The fullest stage's terms (stage_memory): params, grads, optim as held after the step, activations and
    buffers at its peak, and the peak ('total': the gradients in it only when they exist by then); and of its
    states, those of the routed experts ('expert_states', 0 for a dense model)."""
    per = [
        stage_memory(shape, prec, s, attention, lay, st)
        for st in stages(shape, lay.tp, lay.pp, lay.n_micro, ep=lay.ep)
    ]
    worst = max(per, key=lambda d: d["total"])
    assert math.isfinite(worst["total"])
    return {k: v for k, v in worst.items() if k != "moment"}
