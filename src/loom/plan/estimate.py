"""Enumerate (dp, tp, pp, ZeRO stage, micro-batch, activation checkpointing) and estimate each layout.

Mesh order is loom's (config/layout.py, torchtitan's): pp × dp × tp with tp innermost, so a tensor-parallel
group is tp neighbouring ranks (kept inside a node: tp divides gpus_per_node), a data-parallel group spans
dp·tp neighbouring ranks (inside a node while dp·tp <= gpus_per_node, else its all-reduces or FSDP's
gathers cross nodes) and a pipeline group strides over everything (its small stage-to-stage sends are what
crosses nodes first). A group inside a node uses the intra-node bandwidth, one that crosses nodes the
inter-node bandwidth.
Bandwidths are nccl-tests bus bandwidths (what `loom bench comm` prints as busbw): a ring all-reduce of
M bytes over n ranks takes 2·(n-1)/n·M / busbw; an all-gather or reduce-scatter half that.

Time model, per optimizer step, with m micro-batches per data-parallel rank:
  * compute: FLOPs per token as loom.model.flops (PaLM appendix B: 6·N + 12·L·h·s; full recomputation
    repeats the forward: 8·N + 16·L·h·s) at peak_tflops · mfu; a micro-batch on one stage costs
    flops·b·s / (tp·pp);
  * TP (Megatron, Shoeybi et al. 2019): 2 all-reduces of b·s·h activations per layer forward and 2
    backward (3 + 3 with full recomputation; with sequence parallelism all-gather + reduce-scatter, the
    same volume), on the critical path;
  * PP: one b·s·h/tp activation sent forward and one gradient back per micro-batch and stage boundary;
    1F1B or GPipe take (m + pp - 1) slots for m micro-batches: bubble (pp - 1)/(m + pp - 1) (Narayanan
    et al. 2021, "Efficient large-scale language model training on GPU clusters", section 2.2);
  * DP (ZeRO paper section 7): plain DP and ZeRO-1 accumulate full gradients and all-reduce them once
    per step, 2·(dp-1)/dp·Ψ·grad_bytes (ZeRO-1 as reduce-scatter + all-gather of the updated
    parameters: the same volume). ZeRO-2 keeps only a gradient shard, so every micro-batch's gradients
    are reduce-scattered, plus one parameter all-gather per step; at m = 1 the all-reduce's volume.
    ZeRO-3 all-gathers the parameters for forward and again for backward of every micro-batch and
    reduce-scatters the gradients: 1.5× the all-reduce at m = 1 (section 7.2.2). HSDP (ZeRO-3 within
    groups of dp/r neighbouring ranks, r replicas: torchtitan's dp_replicate × dp_shard, PyTorch FSDP's
    hybrid sharding) moves that traffic over the shard group only (inside a node when it fits one) and
    all-reduces each gradient shard (Ψ/shard) across the replicas once per step; the model states are
    sharded shard ways, not dp ways. Bytes as loom moves them: gradients reduced in fp32 (DDP's buckets,
    FSDP's reduce_dtype), FSDP's parameters gathered in its param_dtype (bf16 when training in bf16), so
    ZeRO-3 at m = 1 moves as much as the all-reduce in bf16 training rather than the paper's 1.5×. DP traffic overlaps
    with backward (ZeRO-1: the last micro-batch's; ZeRO-2: every micro-batch's; ZeRO-3: all compute,
    prefetching); only what is left adds to the step.
  * Mixtures of experts (loom.model.moe, loom.parallel.expert): compute on active parameters (a MoE layer's
    router, top_k routed and shared experts), and not divided by tp: each tensor-parallel rank runs the MoE
    layer whole on its gathered tokens. Expert parallelism (ep of the dp x cp ranks, the innermost: a group of
    ep·tp neighbouring ranks, inside a node while ep·tp <= gpus_per_node) sends each routed copy of a token to
    its expert's rank and back: per MoE layer and micro-batch 4 all-to-alls of b·s/cp·k·C activations
    (dispatch and combine, forward and backward; 6 with full recomputation, which repeats the forward), of
    which (ep - 1)/ep leaves the rank; an all-to-all moving M bytes off a rank takes M / busbw (nccl-tests'
    alltoall busbw), on the critical path. The routed experts' gradients are reduced over the dp·cp/ep
    ranks that hold the same experts (FSDP's reduce-scatter and gathers there under zero 2/3, one all-reduce
    under DDP). A balanced router is assumed: every rank gets b·s/cp·k rows per MoE layer.
  The optimizer update and kernel launch overheads are left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loom.plan.memory import Finetune, Micro, Precision, moe_mlp_bytes
from loom.plan.peak import Layout, peak_memory, stages
from loom.plan.shapes import ModelShape

GB = 1e9  # decimal gigabytes, as the ZeRO paper and GPU datasheets


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu_mem_gb: float
    intra_bw: float = 200.0  # GB/s bus bandwidth inside a node (NVLink / NVSwitch class)
    inter_bw: float = 25.0  # GB/s per GPU across nodes (one 200 Gb/s InfiniBand NIC per GPU)
    peak_tflops: float = 312.0  # dense 16-bit peak of one GPU (A100 SXM bf16; H100 SXM is 989)
    mfu: float = 0.45  # achievable fraction of peak for large-model training (Megatron reports 40-55%)
    headroom: float = 0.10  # of GPU memory kept for the CUDA context, allocator and temporary buffers
    host_bw: float = 25.0  # GB/s between a GPU and host memory each way (PCIe 4.0 x16): activation offload

    @property
    def usable_gb(self) -> float:
        return self.gpu_mem_gb * (1 - self.headroom)


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    precision: Precision
    seq_len: int
    global_batch_tokens: int
    attention: str = "flash"
    offload: bool = False  # train.activation_offload: saved activations in host memory (plan/peak.py)
    finetune: Finetune | None = None  # LoRA / QLoRA's model states (one GPU: plan/memory.py's Finetune)


@dataclass
class Candidate:
    dp: int
    tp: int
    pp: int
    zero: int
    micro_batch: int
    activation_checkpointing: str
    n_micro: int = 0  # micro-batches per data-parallel rank per step
    replicate: int = 1  # HSDP (zero 3): replicas of a model sharded over dp / replicate ranks
    cp: int = 1  # context parallel (Ulysses): ranks that split each sequence; FSDP shards over them too
    sp: bool = True  # sequence parallel with tp > 1 (the planner's layouts use it; loom's default is off)
    ep: int = 1  # expert parallel (a MoE model): routed experts split over ep of the dp x cp ranks
    memory_gb: dict[str, float] = field(default_factory=dict)
    comm_gb: dict[str, float] = field(default_factory=dict)  # bytes sent per GPU per step, by kind
    compute_s: float = 0.0
    comm_s: float = 0.0  # communication time not hidden behind compute
    step_time_s: float = 0.0
    bubble: float = 0.0
    fits: bool = False
    tokens_per_s: float = 0.0
    reason: str = ""
    moe: dict = field(default_factory=dict)  # a MoE model's figures (evaluate): experts, all-to-all, MFU

    def as_dict(self) -> dict:
        d = {
            k: getattr(self, k)
            for k in (
                "dp",
                "tp",
                "pp",
                "zero",
                "replicate",
                "cp",
                "ep",
                "micro_batch",
                "activation_checkpointing",
                "n_micro",
                "memory_gb",
                "comm_gb",
                "compute_s",
                "comm_s",
                "step_time_s",
                "bubble",
                "fits",
                "tokens_per_s",
                "reason",
                "moe",
            )
        }
        d["sequence_parallel"] = self.tp > 1 and self.sp
        return d


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_degrees(shape: ModelShape, ranks: int, ep: int = 0) -> list[int]:
    """Expert-parallel degrees over `ranks` = dp x cp (as config.validate: ep divides n_experts and dp x cp);
    ep = 0: every such degree, else that one when it is one of them. A dense model: [1]."""
    if not shape.is_moe:
        return [1]
    every = [d for d in _divisors(ranks) if shape.n_experts % d == 0]
    return every if not ep else [ep] if ep in every else []


def enumerate_layouts(
    shape: ModelShape, cluster: Cluster, wl: Workload, attention_modes: tuple[str, ...], ep: int = 0
):
    """Every valid layout. Rules (as config.validate): dp·tp·pp = gpus; tp divides n_head and
    gpus_per_node (tensor parallelism stays inside a node); pp <= n_layer; the global batch splits into
    whole micro-batches per data-parallel rank; 1F1B needs at least pp micro-batches; ZeRO needs dp > 1;
    HSDP (zero 3 with replicate r) needs 1 < r < dp. A mixture of experts: ep divides n_experts and dp·cp
    (`ep` = 0: every such degree), and ep > 1 runs with ddp, zero2 or fsdp (not zero1, nor HSDP: loom's
    expert shards follow one FSDP group)."""
    node = min(cluster.gpus_per_node, cluster.gpus)
    seqs = wl.global_batch_tokens // wl.seq_len
    kv = shape.n_kv_head or shape.n_head
    for tp in _divisors(node):
        if shape.n_head % tp or kv % tp or shape.padded_vocab % tp or wl.seq_len % tp:
            continue
        for pp in _divisors(cluster.gpus // tp) if cluster.gpus % tp == 0 else []:
            if pp > shape.n_layer:
                continue
            for cp in _divisors(cluster.gpus // (tp * pp)):
                # Ulysses (loom's default cp_impl): cp x tp | n_kv_head, the cp group inside a node
                if cp > 1 and ((kv // tp) % cp or node % (cp * tp) or wl.seq_len % (cp * tp)):
                    continue
                dp = cluster.gpus // (tp * pp * cp)
                if seqs % dp:
                    continue
                per_rank = seqs // dp
                for b in (1, 2, 4, 8, 16, 32, 64):
                    if per_rank % b or per_rank // b < pp:
                        continue
                    for e in expert_degrees(shape, dp * cp, ep):
                        # ZeRO-1 composes with neither cp nor ep in loom; with cp FSDP shards over dp x cp
                        zeros = (
                            [z for z in range(4) if (cp == 1 and e == 1) or z != 1] if dp * cp > 1 else [0]
                        )
                        for zero in zeros:
                            for rep in [1] + [r for r in _divisors(dp)[1:-1] if zero == 3 and e == 1]:
                                for ckpt in attention_modes:
                                    yield Candidate(
                                        dp,
                                        tp,
                                        pp,
                                        zero,
                                        b,
                                        ckpt,
                                        n_micro=per_rank // b,
                                        replicate=rep,
                                        cp=cp,
                                        ep=e,
                                    )


def _group_bw(span: int, cluster: Cluster) -> float:
    """A group of `span` consecutive ranks stays inside a node when it fits in one and nodes align."""
    node = cluster.gpus_per_node
    inside = span <= node and node % span == 0
    return cluster.intra_bw if inside or cluster.gpus <= node else cluster.inter_bw


def _stage_params(shape: ModelShape, tp: int, pp: int, ep: int = 1) -> tuple[float, float, int]:
    """(params on the first stage, of them its routed experts', the most MoE layers a stage has) per GPU
    (loom.plan.peak's stages: TP and expert shards, before data-parallel sharding)."""
    every = stages(shape, tp, pp, 1, ep=ep)
    return every[0].params, every[0].expert_params, max(st.moe_blocks for st in every)


def evaluate(c: Candidate, cluster: Cluster, wl: Workload) -> Candidate:
    """Fill in memory, communication, time and fits for one layout."""
    shape, prec, s, b = wl.shape, wl.precision, wl.seq_len, c.micro_batch
    first_p, first_e, moe_stage = _stage_params(shape, c.tp, c.pp, c.ep)
    if c.ep == 1:  # the experts are sharded and reduced as every other parameter
        first_e = 0.0
    ckpt = c.activation_checkpointing
    lay = Layout(
        c.dp, c.tp, c.pp, c.zero, c.replicate, b, c.n_micro, ckpt, c.sp, c.cp, c.ep, wl.offload, wl.finetune
    )
    # context parallel: a rank's activations are those of s / cp tokens (Ulysses' attention sees the whole
    # sequence with n_head / cp heads: the same bytes as s / cp tokens with every head, for flash attention)
    sl = s // c.cp
    memory = peak_memory(shape, prec, sl, wl.attention, lay)
    expert_states = memory.pop("expert_states")
    c.memory_gb = {k: v / GB for k, v in memory.items()}
    c.fits = c.memory_gb["total"] <= cluster.usable_gb
    t_micro = _micro_time(c, cluster, shape, s, b, ckpt)
    if wl.offload:  # each saved activation to the host and back, on the compute stream (not overlapped)
        t_micro += 2 * memory["host"] / (min(c.n_micro, c.pp) if c.pp > 1 else 1) / (cluster.host_bw * GB)
    comm = _stage_comm(c, cluster, shape, prec, b, sl, ckpt, moe_stage)
    tp_bytes, t_tp, cp_bytes, t_cp, ep_bytes, ep_bw, t_ep, pp_bytes, t_pp = comm
    slots = c.n_micro + c.pp - 1
    c.bubble = (c.pp - 1) / slots
    pipe_time = slots * (t_micro + t_tp + t_cp + t_ep + t_pp)
    dp_bytes, t_dp, hide = _dp_comm(c, cluster, prec, first_p, first_e, t_micro)
    c.comm_gb = {
        "dp": dp_bytes / GB,
        "tp": tp_bytes * c.n_micro / GB,
        "cp": cp_bytes * c.n_micro / GB,
        "pp": pp_bytes * c.n_micro / GB,
    }
    if shape.is_moe:
        c.comm_gb["ep"] = ep_bytes * c.n_micro / GB
    c.compute_s = c.n_micro * t_micro
    c.step_time_s = pipe_time + max(0.0, t_dp - hide)
    c.comm_s = c.step_time_s - c.compute_s - c.bubble * pipe_time
    c.tokens_per_s = wl.global_batch_tokens / c.step_time_s
    if shape.is_moe:
        c.moe = _moe_figures(c, cluster, wl, expert_states, moe_stage, ep_bw, t_ep)
    return c


def _micro_time(c: Candidate, cluster: Cluster, shape: ModelShape, s: int, b: int, ckpt: str) -> float:
    """Seconds of compute of one micro-batch on one rank."""
    # compute: a MoE layer's experts on active parameters, whole on every TP rank
    moe_matmul = shape.n_moe * shape.expert_matrices
    matmul = shape.matmul_params() - moe_matmul
    attn = shape.attn_flops(s)
    mm = 8 if ckpt == "full" else 6
    flops_tok = mm * matmul + (attn if ckpt == "none" else attn * 4 / 3)
    flops_rate = cluster.peak_tflops * 1e12 * cluster.mfu
    t_micro = (flops_tok / c.tp + mm * moe_matmul) * b * s / (c.pp * c.cp) / flops_rate
    return t_micro


def _stage_comm(
    c: Candidate, cluster: Cluster, shape: ModelShape, prec, b: int, sl: int, ckpt: str, moe_stage
):
    """(bytes, seconds) per micro-batch of each parallelism inside a pipeline stage (tp, cp, ep: ep's bandwidth
    too) and across its boundaries (pp)."""
    e = prec.act
    # tensor parallel: activations of b·s·h elements, 4 collectives per layer (6 with full recompute)
    layers_stage = math.ceil(shape.n_layer / c.pp)
    n_coll = 6 if ckpt == "full" else 4
    tp_bytes = layers_stage * n_coll * 2 * (c.tp - 1) / c.tp * b * sl * shape.n_embd * e if c.tp > 1 else 0.0
    t_tp = tp_bytes / (_group_bw(c.tp, cluster) * GB)
    # context parallel (Ulysses): per layer four all-to-alls forward (q, k, v to head shards, the output back)
    # and four backward, each moving (cp - 1)/cp of this rank's (b, s/cp, width/tp); recompute repeats forward's
    width = 2 * shape.q_dim + 2 * shape.kv_dim
    cp_bytes = (
        layers_stage * (3 if ckpt == "full" else 2) * (c.cp - 1) / c.cp * b * sl * width / c.tp * e
        if c.cp > 1
        else 0.0
    )
    t_cp = cp_bytes / (_group_bw(c.cp * c.tp, cluster) * GB)
    # expert parallel: per MoE layer 4 all-to-alls (dispatch, combine; forward, backward; 6 with full
    # recompute) of the rank's b·s/cp tokens times k, (ep - 1)/ep of it to other ranks
    ep_bytes = moe_stage * (6 if ckpt == "full" else 4) * b * sl * shape.top_k * shape.n_embd * e
    ep_bytes *= (c.ep - 1) / c.ep
    ep_bw = _group_bw(c.ep * c.tp, cluster)
    t_ep = ep_bytes / (ep_bw * GB)
    # pipeline: forward activation + backward gradient per micro-batch across each stage boundary
    pp_bytes = 2 * b * sl * shape.n_embd * e / c.tp if c.pp > 1 else 0.0
    t_pp = pp_bytes / (_group_bw(cluster.gpus, cluster) * GB)
    return tp_bytes, t_tp, cp_bytes, t_cp, ep_bytes, ep_bw, t_ep, pp_bytes, t_pp


def _dp_comm(c: Candidate, cluster: Cluster, prec, first_p: float, first_e: float, t_micro: float):
    """(bytes, seconds, seconds of it hidden behind compute) of the data-parallel traffic of one step."""
    # data parallel: with cp the gradients are reduced over dp x cp ranks (the cp ranks hold the same
    # parameters), and FSDP shards over them
    ring = (c.dp * c.cp - 1) / (c.dp * c.cp)
    dp_bw = _group_bw(c.dp * c.cp * c.tp, cluster) * GB
    ag = prec.gather_block or prec.gather  # bytes a parameter all-gathers (fp8: the blocks' weights, 1 byte)
    # the routed experts under ep > 1: reduced (and FSDP-gathered) over the dp·cp/ep ranks holding the same
    # ones, the ep·tp-strided ranks of the data-parallel group's span; gathered in 16 bits under fp8 too
    d_e = c.dp * c.cp // c.ep
    ring_e = (d_e - 1) / d_e
    if c.zero == 3:
        e_bytes = first_e * c.n_micro * ring_e * (2 * prec.gather + prec.grad)
    elif c.zero == 2:
        e_bytes = first_e * ring_e * (c.n_micro * prec.grad + prec.gather)
    else:
        e_bytes = first_e * 2 * ring_e * prec.grad
    first_p -= first_e
    if c.zero == 3:
        # FSDP's group: dp / replicate neighbouring ranks (all of dp without HSDP), times cp
        shard = c.dp // c.replicate * c.cp
        gather = first_p * c.n_micro * (shard - 1) / shard * (2 * ag + prec.grad)
        across = (
            2 * (c.replicate - 1) / c.replicate * first_p / shard * prec.grad
        )  # HSDP: the replicas' all-reduce
        dp_bytes = gather + across
        t_dp = gather / (_group_bw(shard * c.tp, cluster) * GB) + across / dp_bw
        hide = c.n_micro * t_micro
    elif c.zero == 2:
        dp_bytes = first_p * ring * (c.n_micro * prec.grad + ag)
        t_dp, hide = dp_bytes / dp_bw, c.n_micro * t_micro * 2 / 3
    else:
        dp_bytes = first_p * 2 * ring * prec.grad
        t_dp, hide = dp_bytes / dp_bw, t_micro * 2 / 3
    dp_bytes += e_bytes
    t_dp += e_bytes / dp_bw
    return dp_bytes, t_dp, hide


def _moe_figures(
    c: Candidate,
    cluster: Cluster,
    wl: Workload,
    expert_states: float,
    moe_stage: int,
    ep_bw: float,
    t_ep: float,
) -> dict:
    """What `loom plan` prints of a MoE layout: where the experts are, their states beside the others', the
    routed activations, the all-to-all's bytes, link and time per step, and the MFU on active parameters."""
    shape, prec = wl.shape, wl.precision
    states = c.memory_gb["params"] + c.memory_gb["grads"] + c.memory_gb["optim"]
    m = Micro(wl.seq_len // c.cp, c.micro_batch, c.tp, c.sp and c.tp > 1, prec)
    kept = 1 if c.activation_checkpointing == "full" else moe_stage  # full: one MoE layer rebuilt at a time
    inside = ep_bw == cluster.intra_bw and c.ep > 1
    model_flops = 6 * shape.matmul_params() + shape.attn_flops(wl.seq_len)
    return {
        "experts_per_rank": shape.n_experts // c.ep,
        "expert_shard": c.dp * c.cp // c.ep if c.zero >= 2 else 1,
        "expert_states_gb": expert_states / GB,
        "other_states_gb": states - expert_states / GB,
        "routed_activations_gb": kept * moe_mlp_bytes(shape, m) / GB,
        "a2a_gb": c.comm_gb["ep"],
        "a2a_s": c.n_micro * t_ep,
        "a2a_link": "none" if c.ep == 1 else "intra-node" if inside else "inter-node",
        "a2a_busbw": ep_bw if c.ep > 1 else 0.0,
        "mfu_active": model_flops * c.tokens_per_s / (cluster.gpus * cluster.peak_tflops * 1e12),
    }


def plan(shape: ModelShape, cluster: Cluster, wl: Workload, ep: int = 0) -> list[Candidate]:
    """Every valid layout, evaluated and ranked: fitting ones first, then by step time (to 3 significant
    digits: the model is not finer than that), then by bytes communicated, then the simpler layout (lower
    ZeRO stage, tp, pp), then by memory."""
    modes = ("none", "full") if wl.attention == "flash" else ("none", "selective", "full")
    cands = [evaluate(c, cluster, wl) for c in enumerate_layouts(shape, cluster, wl, modes, ep)]
    cands.sort(
        key=lambda c: (
            not c.fits,
            float(f"{c.step_time_s:.3g}"),
            sum(c.comm_gb.values()),
            c.zero + c.tp + c.pp,
            c.memory_gb["total"],
        )
    )
    return cands
