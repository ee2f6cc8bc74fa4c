"""`loom plan`: arguments, the one-line reasons, the table and the JSON.

Reasons follow the usual decision rules: the model fits on one GPU → plain data parallel; it does not →
ZeRO / FSDP shards the model states over data-parallel ranks; even that does not fit (one layer's
activations and gathered weights are too large) → tensor parallel inside a node; inter-node links much
slower than intra-node → pipeline stages across nodes, so only point-to-point activations cross them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from loom.errors import LoomError
from loom.plan.estimate import Candidate, Cluster, Workload, plan
from loom.plan.memory import ATTENTION, PRECISIONS, Finetune
from loom.plan.shapes import PRESETS, ModelShape, assert_valid, fmt_count, resolve_model

_ZERO_WHAT = {
    1: "optimizer state",
    2: "optimizer state + gradients",
    3: "optimizer state, gradients, parameters",
}


@dataclass(frozen=True)
class DataParallelOnly:
    """What the layouts without tp or pp say, which every layout's reason compares against (once for all of
    them: a plan at 512 GPUs has ~10,000 layouts)."""

    replicated_fits: bool  # plain DDP fits
    fits: bool  # DP or ZeRO alone fits
    replicated_states_gb: float  # the model states of a replicated layout (their mean)
    lowest_gb: float  # the least memory a layout without tp or pp needs

    @classmethod
    def of(cls, cands: list[Candidate]) -> DataParallelOnly:
        flat = [x for x in cands if x.tp == 1 and x.pp == 1]
        replicated = [x for x in flat if x.zero == 0]
        return cls(
            any(x.fits for x in replicated),
            any(x.fits for x in flat),
            sum(map(model_state, replicated)) / max(1, len(replicated)),
            min((x.memory_gb["total"] for x in flat), default=float("nan")),
        )


def reason(c: Candidate, flat: DataParallelOnly, cluster: Cluster) -> str:
    """One line: why this layout, by the decision rules, with the numbers that decide."""
    usable = cluster.usable_gb
    replicated_fits, dp_fits = flat.replicated_fits, flat.fits
    parts = []
    if c.zero == 0 and c.tp == c.pp == 1:
        single = (
            "fits on one GPU: no parallelism needed"
            if c.dp == 1
            else "fits on one GPU → plain data parallel (DDP)"
        )
        parts.append(single if c.fits else "replicated: too big")
    if c.zero:
        states = flat.replicated_states_gb
        if replicated_fits and c.tp == c.pp == 1:
            parts.append(f"ZeRO-{c.zero} not required; shards {_ZERO_WHAT[c.zero]} over dp={c.dp}")
        else:
            need = f" (replicated states {states:.0f} GB > {usable:.0f} usable)" if states > usable else ""
            name = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}[c.zero]
            over = f"dp x cp = {c.dp * c.cp}" if c.cp > 1 else f"dp={c.dp}"
            parts.append(f"{name} shards {_ZERO_WHAT[c.zero]} over {over}{need}")
    if c.replicate > 1:
        shard = c.dp // c.replicate * c.cp
        where = (
            "inside a node" if shard * c.tp <= min(cluster.gpus_per_node, cluster.gpus) else "across nodes"
        )
        parts[-1] = (
            f"HSDP: FSDP over groups of {shard} {where}, {c.replicate} replicas all-reduce gradient "
            f"shards (--parallel.dp_replicate={c.replicate})"
        )
    if c.cp > 1:
        parts.append(
            f"CP={c.cp} (Ulysses) inside a node: each rank holds 1/{c.cp} of every sequence's activations"
        )
    if c.ep > 1:
        link = c.moe.get("a2a_link", "")
        parts.append(
            f"EP={c.ep}: {c.moe.get('experts_per_rank')} experts per rank, all-to-all {link} "
            f"({c.moe.get('a2a_s', 0):.2f} s/step)"
        )
    if c.zero == 0 and c.dp > 1 and (c.tp > 1 or c.pp > 1):
        parts.append("no ZeRO: TP/PP alone split the model states")
    if c.tp > 1:
        if dp_fits:
            parts.append(f"TP={c.tp} inside a node (not required: DP/ZeRO alone fits)")
        else:
            parts.append(
                f"DP/ZeRO alone needs ≥ {flat.lowest_gb:.0f} GB > {usable:.0f} → TP={c.tp} inside a node"
            )
    if c.pp > 1:
        crosses = c.tp * c.pp > min(cluster.gpus_per_node, cluster.gpus)
        slow = cluster.inter_bw * 2 <= cluster.intra_bw
        where = "across nodes" if crosses else "inside a node"
        why = (
            f" (slow inter-node link {cluster.inter_bw:g} GB/s: only activations cross it)"
            if crosses and slow
            else ""
        )
        parts.append(f"PP={c.pp} {where}{why}, bubble {c.bubble:.0%}")
    if c.activation_checkpointing != "none":
        parts.append(
            f"{c.activation_checkpointing} recompute (activations {c.memory_gb['activations']:.1f} GB)"
        )
    if not c.fits:
        parts.insert(0, f"DOES NOT FIT ({c.memory_gb['total']:.0f} > {usable:.0f} GB)")
    return "; ".join(parts)


def model_state(c: Candidate) -> float:
    return c.memory_gb["params"] + c.memory_gb["grads"] + c.memory_gb["optim"]


def table(cands: list[Candidate], moe: bool = False) -> str:
    """The layouts, one a row (an ep column for a mixture of experts, a host column with activation offload)."""
    host = "host" in cands[0].memory_gb
    head = (
        f" #  dp  cp  tp  pp{'  ep' if moe else ''} zero rep  mb  ckpt  |  params  grads  optim   act  bufs  peak GB"
        f"{'  host GB' if host else ''} | comm GB   step s  bubble   tok/s | fits | reason"
    )
    rows = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        m = c.memory_gb
        comm = sum(c.comm_gb.values())
        ep = f" {c.ep:>3}" if moe else ""
        moved = f" {m['host']:>8.1f}" if host else ""
        rows.append(
            f"{i:>2} {c.dp:>3} {c.cp:>3} {c.tp:>3} {c.pp:>3}{ep} {c.zero:>4} {c.replicate:>3} {c.micro_batch:>3}  {c.activation_checkpointing[:4]:<4}"
            f"  | {m['params']:>7.1f} {m['grads']:>6.1f} {m['optim']:>6.1f} {m['activations']:>5.1f}"
            f" {m['buffers']:>5.1f} {m['total']:>6.1f}{moved}    | {comm:>7.1f} {c.step_time_s:>8.2f} {c.bubble:>6.1%} {fmt_count(c.tokens_per_s):>7}"
            f" | {'yes' if c.fits else 'NO':<4} | {c.reason}"
        )
    return "\n".join(rows)


def moe_table(cands: list[Candidate]) -> str:
    """A mixture of experts' figures for the same rows: the experts' place and states, routed activations, the
    all-to-all per step and the link it crosses, and the MFU on active parameters."""
    head = (
        " #  ep experts/rank efsdp | expert states  other states  routed act/layers | all-to-all GB  link"
        "        busbw  s/step | MFU active"
    )
    rows = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        f = c.moe
        link = f"{f['a2a_link']:<11} {f['a2a_busbw']:>5.0f}" if c.ep > 1 else f"{'(no ep)':<11} {'-':>5}"
        rows.append(
            f"{i:>2} {c.ep:>3} {f['experts_per_rank']:>12} {f['expert_shard']:>5} | {f['expert_states_gb']:>13.1f}"
            f" {f['other_states_gb']:>13.1f} {f['routed_activations_gb']:>17.1f} | {f['a2a_gb']:>13.1f}  {link}"
            f" {f['a2a_s']:>7.2f} | {f['mfu_active']:>9.1%}"
        )
    return "\n".join(rows)


def moe_header(shape: ModelShape, wl: Workload) -> str:
    """Total and active parameters, the experts, and the FLOPs a token costs on active parameters."""
    flops = 6 * shape.matmul_params() + shape.attn_flops(wl.seq_len)
    shared = f" + {shape.n_shared} shared" if shape.n_shared else ""
    return (
        f"moe       {fmt_count(shape.param_count())} parameters, {fmt_count(shape.active_params())} active per token; "
        f"{shape.n_experts} routed experts (top-{shape.top_k}{shared}) of width {shape.expert_width} in "
        f"{shape.n_moe} of {shape.n_layer} layers, {fmt_count(shape.routed_params)} routed parameters a layer; "
        f"{flops / 1e9:.0f} GFLOP/token on active parameters (6 x {fmt_count(shape.matmul_params())} + "
        "attention); experts not TP-sharded (each tp rank runs a MoE layer whole), split over ep of the "
        "dp x cp ranks\n"
        "          MoE table: expert states (params, grads, optim of the rank's E/ep experts, sharded over efsdp ="
        " dp x cp / ep under zero 2/3) and the rest's; routed activations of a micro-batch's MoE layers"
        " (one under full recompute); all-to-all bytes per GPU per step (dispatch + combine, forward +"
        " backward: 4 x tokens x k x C x bytes x (ep-1)/ep a layer) and the link of the ep x tp ranks;"
        " MFU on active parameters at the estimated step time"
    )


def header(shape: ModelShape, cluster: Cluster, wl: Workload, n: int, n_fit: int) -> str:
    p = wl.precision
    nodes = max(1, cluster.gpus // cluster.gpus_per_node)
    return "\n".join(
        [
            f"model     {shape.describe()}",
            f"cluster   {cluster.gpus} GPUs, {cluster.gpus_per_node} per node ({nodes} node{'s' * (nodes > 1)}), "
            f"{cluster.gpu_mem_gb:g} GB each ({cluster.usable_gb:.0f} GB usable, {cluster.headroom:.0%} headroom); "
            f"busbw {cluster.intra_bw:g} GB/s intra-node, {cluster.inter_bw:g} GB/s inter-node",
            f"training  {p.name}: {p.param}+{p.grad}+{p.optim} bytes/param ({p.doc}), {p.act}-byte activations; "
            f"seq {wl.seq_len}, global batch {wl.global_batch_tokens:,} tokens ({wl.global_batch_tokens // wl.seq_len} "
            f"sequences), {wl.attention} attention, 1F1B",
            f"compute   {cluster.peak_tflops:g} TFLOP/s peak × {cluster.mfu:g} achieved per GPU",
            f"{n} valid layouts, {n_fit} fit; memory in GB (1e9 bytes) per GPU on the fullest pipeline stage: "
            "params, grads, optim held after a step; act, bufs (FSDP's gathered blocks, DDP's buckets) and "
            "their sum with the states at the step's peak (loom/plan/peak.py)",
        ]
        + (
            [
                "offload   train.activation_offload: act is what stays on the GPU (the block or head whose "
                "backward runs, its activations copied back; the loss's temporaries; the batch; autocast's weight "
                "casts, cached through the forward; a pipeline's stage outputs and receive buffers); host GB is "
                "the pinned host memory per GPU for the saved activations of the micro-batches in flight (not "
                "checked against the host's RAM); the copies, each way at 25 GB/s (PCIe 4.0), add to the step time"
            ]
            if wl.offload
            else []
        )
        + ([_finetune_line(shape, wl.finetune)] if wl.finetune is not None else [])
    )


def _finetune_line(shape: ModelShape, ft: Finetune) -> str:
    """What a --lora-rank plan counts instead of the 4+4+8 of full training."""
    base = "NF4 (0.516 bytes a weight, loom.model.nf4)" if ft.quantize == "nf4" else "fp32 (4 bytes)"
    state = {"": "fp32 (8 bytes)", "int8": "int8 (2.03 bytes)", "int4": "int4 (1.06 bytes)"}[ft.state_dtype]
    where = (
        "on the host (optim_host GB: moments and an fp32 copy, 12 bytes an adapter weight)"
        if ft.offload
        else state
    )
    return (
        f"finetune  LoRA rank {ft.rank} on every block linear ({fmt_count(ft.adapter_params(shape, shape.n_layer))} "
        f"adapter weights): the base's linears in {base}, embeddings, norms and head in fp32, frozen; params = "
        f"base + adapters, grads the adapters', optim AdamW's moments of the adapters {where}; the step time "
        "counts full training's FLOPs (LoRA's are ~2/3)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom plan",
        description="Rank (dp, tp, pp, ZeRO, micro-batch, activation checkpointing) layouts by per-GPU "
        "memory and estimated step time.",
        epilog="Formulas: ZeRO (Rajbhandari et al. 2020) for model states, activations tensor by tensor as "
        "loom's block keeps them (after Korthikanti et al. 2022), checked against loom train --dry-run; see "
        "loom/plan/*.py. Example: loom plan --model 7b --gpus 64 --gpus-per-node 8 --gpu-mem 80",
    )
    p.add_argument("--model", help=f"a preset ({', '.join(PRESETS)}) or CONFIG.toml")
    p.add_argument("--params", help="a bare parameter count (7.5B, 124M); alone, a shape is assumed")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in GB")
    p.add_argument(
        "--intra-bw", type=float, default=200.0, help="intra-node bus bandwidth, GB/s (default 200)"
    )
    p.add_argument(
        "--inter-bw", type=float, default=25.0, help="inter-node bus bandwidth per GPU, GB/s (default 25)"
    )
    p.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="the link of each node to the others in Gbit/s (shared by its GPUs; replaces --inter-bw): the "
        "report says whether bf16/PowerSGD gradients or DiLoCo pay off across it",
    )
    p.add_argument(
        "--activation-offload",
        action="store_true",
        help="train.activation_offload: saved activations in host memory; act counts what stays on the GPU "
        "(a block's, copied back for its backward, the head's and the loss's) and a host column what moves",
    )
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's block_size)")
    p.add_argument(
        "--global-batch-tokens",
        type=int,
        help="tokens per optimizer step (default 2^22 from 1B parameters, else 2^19)",
    )
    p.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS), help="default bf16-mixed")
    p.add_argument(
        "--attention",
        default="flash",
        choices=ATTENTION,
        help="flash: fused SDPA kernels, no s×s scores kept (loom's default); eager: Korthikanti's "
        "5·a·s²·b term",
    )
    p.add_argument(
        "--peak-tflops", type=float, default=312.0, help="per-GPU dense peak (default 312, A100 bf16)"
    )
    p.add_argument("--mfu", type=float, default=0.45, help="achieved fraction of peak (default 0.45)")
    p.add_argument(
        "--headroom", type=float, default=0.10, help="share of GPU memory kept free (default 0.10)"
    )
    p.add_argument(
        "--ep",
        type=int,
        default=0,
        help="a mixture of experts' expert-parallel degree (parallel.ep; divides n_experts and dp x cp); "
        "default 0: every such degree",
    )
    _add_lora_args(p.add_argument_group("one-GPU fine-tuning (LoRA, QLoRA)"))
    p.add_argument("--top", type=int, default=10, help="rows printed (default 10)")
    p.add_argument("--json", action="store_true", help="print every candidate as JSON")
    return p


def _add_lora_args(p) -> None:
    """--lora-rank and what shrinks a one-GPU fine-tune's memory (an NF4 base, low-bit or offloaded states)."""
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="plan a LoRA fine-tune (finetune.lora_rank, adapters on every linear): a frozen base, the adapters' "
        "gradients and AdamW state only; one GPU (--gpus 1)",
    )
    p.add_argument(
        "--quantize-base",
        default="none",
        choices=("none", "nf4"),
        help="with --lora-rank: finetune.quantize_base=nf4, QLoRA's 4-bit base (0.516 bytes a weight)",
    )
    p.add_argument(
        "--optim-state",
        default="",
        choices=("", "int8", "int4"),
        help="with --lora-rank: optim.state_dtype, torchao's low-bit AdamW moments",
    )
    p.add_argument(
        "--optim-offload",
        action="store_true",
        help="with --lora-rank: optim.offload=cpu, AdamW's state on the host (a host column)",
    )


def _check(args: argparse.Namespace) -> None:
    positive = {
        "--gpus": args.gpus,
        "--gpus-per-node": args.gpus_per_node,
        "--gpu-mem": args.gpu_mem,
        "--intra-bw": args.intra_bw,
        "--inter-bw": args.inter_bw,
        "--peak-tflops": args.peak_tflops,
        "--top": args.top,
    }
    for flag, v in positive.items():
        if not v > 0:
            raise LoomError(f"{flag} must be positive, got {v}")
    if args.ep < 0:
        raise LoomError(f"--ep must be >= 0, got {args.ep}", hint="leave --ep out to try every degree")
    if args.inter_node_gbps is not None and not args.inter_node_gbps > 0:
        raise LoomError(f"--inter-node-gbps must be positive, got {args.inter_node_gbps}")
    if not 0 < args.mfu <= 1:
        raise LoomError(f"--mfu must be in (0, 1], got {args.mfu}")
    if not 0 <= args.headroom < 1:
        raise LoomError(f"--headroom must be in [0, 1), got {args.headroom}")
    for flag, v in {"--seq-len": args.seq_len, "--global-batch-tokens": args.global_batch_tokens}.items():
        if v is not None and v < 1:  # 0 must not silently mean "the default"
            raise LoomError(f"{flag} must be positive, got {v}", hint=f"leave {flag} out for the default")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise LoomError(
            f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes",
            hint="give a multiple of --gpus-per-node (or fewer GPUs than one node)",
        )


def _check_ep(shape: ModelShape, ep: int) -> None:
    """--ep as config.validate checks parallel.ep: a MoE model's, dividing n_experts (the dp x cp rule is
    the enumeration's)."""
    if not ep:
        return
    if not shape.is_moe:
        if ep > 1:
            raise LoomError(
                f"--ep {ep}: {shape.name} is not a mixture of experts",
                hint="expert parallelism is for model.family=moe; leave --ep out",
            )
        return
    if shape.n_experts % ep:
        divisors = ", ".join(str(d) for d in range(1, shape.n_experts + 1) if shape.n_experts % d == 0)
        raise LoomError(
            f"--ep {ep} does not divide n_experts={shape.n_experts} (each rank holds whole experts)",
            hint=f"pick ep among the divisors of n_experts: {divisors}",
        )


def run_plan(args: argparse.Namespace) -> tuple[ModelShape, Cluster, Workload, list[Candidate]]:
    """Resolve the inputs and rank every layout; raise LoomError when none is valid or none fits."""
    _check(args)
    shape = resolve_model(args.model, args.params)
    if shape.assumed and args.seq_len is not None:
        shape = replace(shape, block_size=args.seq_len)
    assert_valid(shape)
    _check_ep(shape, args.ep)
    s = shape.block_size if args.seq_len is None else args.seq_len
    if s > shape.block_size or s < 1:
        raise LoomError(
            f"--seq-len {s} is outside the model's context of {shape.block_size} tokens",
            hint="a config with a larger model.block_size, or a shorter --seq-len",
        )
    tokens = args.global_batch_tokens
    if tokens is None:
        tokens = 2**22 if shape.param_count() >= 1e9 else 2**19
    if tokens % s or tokens < s:
        raise LoomError(
            f"--global-batch-tokens {tokens} is not a whole number of {s}-token sequences",
            hint=f"a multiple of {s}, e.g. {max(1, tokens // s) * s}",
        )
    inter_bw = args.inter_bw
    if args.inter_node_gbps is not None:  # Gbit/s of a node's link, shared by its GPUs -> GB/s per GPU
        inter_bw = args.inter_node_gbps / 8 / min(args.gpus_per_node, args.gpus)
    cluster = Cluster(
        args.gpus,
        args.gpus_per_node,
        args.gpu_mem,
        args.intra_bw,
        inter_bw,
        args.peak_tflops,
        args.mfu,
        args.headroom,
    )
    wl = Workload(
        shape,
        PRECISIONS[args.precision],
        s,
        tokens,
        args.attention,
        args.activation_offload,
        _finetune(args, shape),
    )
    cands = plan(shape, cluster, wl, args.ep)
    if not cands and args.ep > 1:
        raise LoomError(
            f"--ep {args.ep} divides the data-parallel x cp ranks (dp x cp) of no valid layout of {args.gpus} GPUs "
            f"for {shape.name} (expert parallelism splits the experts over those ranks)",
            hint="a smaller --ep, more GPUs, or leave --ep out to try every degree",
        )
    if not cands:
        raise LoomError(
            f"no valid layout of {args.gpus} GPUs for {shape.name}: {tokens // s} sequences per step "
            f"do not split over any data-parallel degree with tp | {shape.n_head} heads, "
            f"pp <= {shape.n_layer} layers",
            hint="a global batch with more sequences (a multiple of the GPU count), or another GPU count",
        )
    flat = DataParallelOnly.of(cands)
    for c in cands:
        c.reason = reason(c, flat, cluster)
    if not cands[0].fits:
        best = min(cands, key=lambda c: c.memory_gb["total"])
        need = best.memory_gb["total"] / (1 - cluster.headroom)
        raise LoomError(
            f"{shape.name} ({fmt_count(shape.param_count())} parameters) fits nowhere on {args.gpus} × "
            f"{args.gpu_mem:g} GB GPUs: the smallest of {len(cands)} layouts needs {best.memory_gb['total']:.1f} GB "
            f"per GPU (dp={best.dp} tp={best.tp} pp={best.pp} zero={best.zero} micro_batch={best.micro_batch} "
            f"{best.activation_checkpointing} recompute), i.e. GPUs of at least {need:.1f} GB with "
            f"{cluster.headroom:.0%} headroom",
            hint="more GPUs, larger GPUs, a shorter --seq-len, or a smaller model",
        )
    return shape, cluster, wl, cands


def _finetune(args: argparse.Namespace, shape: ModelShape) -> Finetune | None:
    """--lora-rank and its options as the planner's Finetune (None without --lora-rank); what loom refuses for a
    LoRA run is refused here too (loom.config.validate._check_qlora)."""
    extras = args.quantize_base != "none" or args.optim_state or args.optim_offload
    if not args.lora_rank:
        if extras:
            raise LoomError(
                "--quantize-base, --optim-state and --optim-offload plan a LoRA run",
                hint="add --lora-rank 16, say",
            )
        return None
    if args.gpus != 1 or shape.is_moe:
        raise LoomError(
            "--lora-rank plans a LoRA fine-tune of a dense model on one GPU (the planner counts one GPU's LoRA "
            "states; loom also runs QLoRA under FSDP: measure that layout with loom train --dry-run --world N)",
            hint="use --gpus 1",
        )
    if args.optim_state and args.optim_offload:
        raise LoomError(
            "--optim-state with --optim-offload: choose one (as optim.state_dtype and optim.offload)"
        )
    return Finetune(args.lora_rank, args.quantize_base, args.optim_state, args.optim_offload)


def finetune_overrides(args: argparse.Namespace) -> list[str]:
    """The loom config keys a planned LoRA/QLoRA run trains with (--lora-rank and its options), for the dry
    runs of `loom plan --check`: adapters on every linear of the blocks (the planner's Finetune counts those)."""
    if not args.lora_rank:
        return []
    out = [f"--finetune.lora_rank={args.lora_rank}", "--finetune.lora_targets=all-linear"]
    out.append(f"--finetune.quantize_base={args.quantize_base}")
    if args.optim_state:
        out.append(f"--optim.state_dtype={args.optim_state}")
    if args.optim_offload:
        out.append("--optim.offload=cpu")
    return out


def plan_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    shape, cluster, wl, cands = run_plan(args)
    if args.json:
        print(
            json.dumps(
                {
                    "model": {
                        "name": shape.name,
                        "params": shape.param_count(),
                        "n_layer": shape.n_layer,
                        "n_head": shape.n_head,
                        "n_embd": shape.n_embd,
                        "vocab_size": shape.vocab_size,
                        "shape_assumed": shape.assumed,
                        **(_moe_model(shape, wl.seq_len) if shape.is_moe else {}),
                    },
                    "cluster": vars(cluster),
                    "precision": wl.precision.name,
                    "seq_len": wl.seq_len,
                    "global_batch_tokens": wl.global_batch_tokens,
                    "attention": wl.attention,
                    "candidates": [c.as_dict() for c in cands],
                },
                indent=1,
            )
        )
        return 0
    n_fit = sum(c.fits for c in cands)
    print(header(shape, cluster, wl, len(cands), n_fit))
    if shape.is_moe:
        print(moe_header(shape, wl))
    print(table(cands[: args.top], shape.is_moe))
    if shape.is_moe:
        print(moe_table(cands[: args.top]))
    if args.inter_node_gbps is not None:
        from loom.plan.slow_links import advice

        print("\n".join(advice(cands[0], cluster, shape, args.inter_node_gbps, wl.precision.grad)))
    return 0


def _moe_model(shape: ModelShape, seq_len: int) -> dict:
    return {
        "active_params": shape.active_params(),
        "n_experts": shape.n_experts,
        "top_k": shape.top_k,
        "n_shared": shape.n_shared,
        "expert_width": shape.expert_width,
        "moe_layers": shape.n_moe,
        "flops_per_token_active": 6 * shape.matmul_params() + shape.attn_flops(seq_len),
    }
