"""The job a dry run stands for: its layout checked as a real job checks it, the GPU's precision choices, the
ranks that differ, and the planner's estimate of the same layout (loom.plan) to set beside the measurement."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loom.config import Config, ParallelDims, load_config, validate
from loom.errors import LoomError

GIB = 2**30
# GPU memory in GiB by device-name substring (as loom.metrics.GPU_PEAK_TFLOPS), for --gpu without --gpu-mem
GPU_MEM_GIB = {
    "H200": 141.0,
    "H100": 80.0,
    "A100": 80.0,
    "L40S": 48.0,
    "A10G": 24.0,
    "L4": 24.0,
    "V100": 32.0,
}


@dataclass(frozen=True)
class Target:
    """The machines the job would run on."""

    world: int
    gpus_per_node: int = 8
    gpu: str = "H100"
    gpu_mem_gib: float = 80.0
    headroom: float = 0.10  # as loom.plan.Cluster: CUDA context, allocator caches, NCCL buffers

    @property
    def usable(self) -> float:
        """Bytes a rank may use."""
        return self.gpu_mem_gib * GIB * (1 - self.headroom)


def pipeline_supported() -> bool:
    """Whether this torch's pipeline stages take static shapes the way the dry run sets them (a feature check:
    loom.compat.pipeline_static_shapes_supported: torch 2.13; 2.11 has no such switch)."""
    from loom import compat

    return compat.pipeline_static_shapes_supported()


def check_layout(cfg: Config, target: Target) -> ParallelDims:
    """Every rule a real job runs on its layout before anything else (loom.train.job_dims: config.validate on
    the launcher's world, then the warning for collectives that cross nodes), as rank 0 of `target.world`."""
    from loom.env import DistEnv
    from loom.train import job_dims

    per_node = min(target.gpus_per_node, target.world)
    env = DistEnv(0, 0, target.world, per_node, 0, math.ceil(target.world / per_node), "", 0, "none")
    dims = job_dims(cfg, env)
    if cfg.optim.name == "muon":
        raise LoomError(
            "optim.name=muon: the dry run's tensors hold no values, and Muon's AdamW part reads its step "
            "count (loom.optim.muon: state['step'].item() of a torch.zeros(()))",
            hint="dry-run with optim.name=adamw (Muon's state: one momentum buffer per matrix, AdamW's "
            "two for the rest)",
        )
    from loom.model.registry import spec_of

    why = spec_of(cfg).no_dry_run  # the family's reason it cannot be stepped without values (a MoE's routing)
    if why:
        raise LoomError(
            f"model.family={cfg.model.family}: {why}",
            hint="estimate the layout with loom plan --model CONFIG.toml (a MoE's expert memory and all-to-all "
            "assume a balanced router), or measure it on the devices",
        )
    if dims.pp > 1 and not pipeline_supported():
        import torch

        raise LoomError(
            f"parallel.pp={dims.pp}: the dry run gives each pipeline stage its shapes without the warm-up "
            f"exchange through torch's pipelining internals of 2.13 (InferenceMode), which torch "
            f"{torch.__version__} lacks",
            hint="dry-run pipeline layouts with torch >= 2.13 (a layout with parallel.pp=1 runs here)",
        )
    if dims.dp_impl == "mpi":
        raise LoomError(
            "parallel.dp_impl=mpi synchronises gradients through mpi4py, outside torch.distributed, "
            "which the dry run's fake process group stands in for",
            hint="dry-run the same layout with parallel.dp_impl=ddp (the same memory: replicas)",
        )
    return dims


def gpu_precision(cfg: Config, gpu: str) -> str:
    """precision.dtype as the job would resolve it on `gpu` (loom.train.setup.resolve_precision's rule: auto is
    bf16 where the GPU has bf16, else fp16 with loss scaling, fp32 with pipeline parallel), and the trainer's
    refusal of bf16 on a GPU without it."""
    from loom.metrics import GPU_PEAK_TFLOPS

    peaks = next((v for k, v in GPU_PEAK_TFLOPS.items() if k.lower() in gpu.lower()), {"bf16": 0.0})
    has_bf16 = "bf16" in peaks
    dtype = cfg.precision.dtype
    if dtype == "auto":
        return "bf16" if has_bf16 else ("fp16" if cfg.parallel.pp == 1 else "fp32")
    if dtype == "bf16" and not has_bf16:
        raise LoomError(
            f"precision.dtype=bf16 but this GPU ({gpu}) has no bf16", hint="use precision.dtype=fp16"
        )
    return dtype


def gpu_config(cfg: Config, precision: str) -> Config:
    """cfg with FSDP's mixed precision as it resolves on a GPU (loom.parallel.fsdp.mp_policy: bf16 gathered
    parameters when training in bf16, fp32 reduction), written out so the CPU device of the dry run applies it."""
    import torch

    from loom.metrics import DTYPES
    from loom.parallel.fsdp import mp_policy

    p = cfg.parallel
    if p.param_dtype:  # given: the same on any device
        return cfg
    policy = mp_policy("", p.reduce_dtype, torch.device("cuda"), precision)
    name = {v: k for k, v in DTYPES.items()}
    resolved = replace(
        p, param_dtype=name.get(policy.param_dtype, ""), reduce_dtype=name.get(policy.reduce_dtype, "")
    )
    return replace(cfg, parallel=resolved)


def vocab_size(cfg: Config) -> int:
    """The vocabulary the model is built for: model.vocab_size, else the data's (data.path's meta.json)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    from loom.data.mix import data_path

    if path := data_path(cfg.data):  # data.path, or data.mix's first source
        from loom.data.loader import read_meta

        return int(read_meta(path)["vocab_size"])
    raise LoomError(
        "model.vocab_size=0 takes the vocabulary from the data, and no data.path is given",
        hint="give --model.vocab_size=N (e.g. 128256 for Llama 3) or --data.path=DIR",
    )


def ranks_to_measure(cfg: Config, dims: ParallelDims, vocab: int) -> list[tuple[int, list[int]]]:
    """One rank per role, with the pipeline ranks it stands for: data-parallel rank 0 (FSDP's largest shards
    when a dimension does not divide), context-parallel rank 0, and TP rank 0 of the first and the last
    pipeline rank and of the first of the middle ones with each block count (those after it hold the same
    blocks and fewer micro-batches in flight: 1F1B keeps pp - s of them on pipeline rank s, GPipe all on
    each); and the last TP rank of the last pipeline rank when its shard of the vocabulary-parallel head
    holds padding ids (their logits are masked on a copy). TP ranks are otherwise alike, and so are data- and
    context-parallel ranks."""
    from loom.dryrun.blocks import rank_blocks
    from loom.model.registry import spec_of

    per_stage = dims.world_size // dims.pp  # dp x cp x tp ranks, tp innermost
    last = dims.pp - 1
    roles: dict[int, list[int]] = {0: [0]}
    first_with: dict[int, int] = {}
    for s in range(1, last):
        n = rank_blocks(cfg, dims.world_size, s * per_stage, vocab)
        first_with.setdefault(n, s)
        roles.setdefault(first_with[n], []).append(s)
    if last:
        roles[last] = [last]
    ranks = [(s * per_stage, sorted(set(stood))) for s, stood in sorted(roles.items())]
    mcfg = spec_of(cfg).config(cfg, vocab)
    if dims.tp > 1 and mcfg.padded_vocab != mcfg.vocab_size:
        ranks.append((last * per_stage + dims.tp - 1, [last]))
    return ranks


# ----------------------------------------------------------------------------- the planner's view
def planner_inputs(cfg: Config, target: Target, vocab: int, precision: str):
    """(shape, cluster, workload) of loom.plan for this job."""
    from loom.plan import PRECISIONS, Cluster, Workload
    from loom.plan.shapes import shape_of_model

    m = cfg.model
    shape = shape_of_model(m, vocab)
    cluster = Cluster(
        target.world, target.gpus_per_node, target.gpu_mem_gib * GIB / 1e9, headroom=target.headroom
    )
    prec = {"fp32": "fp32", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}[precision]
    if prec == "bf16-mixed" and cfg.precision.fp8 == "tensorwise":  # weights all-gathered in float8
        prec = "fp8-mixed"
    wl = Workload(
        shape,
        PRECISIONS[prec],
        m.block_size,
        cfg.train.batch_size * m.block_size,
        offload=cfg.train.activation_offload,
    )
    return shape, cluster, wl


def zero_stage(dims: ParallelDims) -> int:
    """The ZeRO stage of loom's data-parallel implementation (tp/pp layouts' ddp is FSDP with one shard)."""
    if dims.dp_impl in ("fsdp", "zero2") and dims.fsdp_shard > 1:
        return 3 if dims.dp_impl == "fsdp" else 2
    return 1 if dims.dp_impl == "zero1" else 0


def planner_estimate(cfg: Config, dims: ParallelDims, target: Target, vocab: int, precision: str):
    """loom.plan's estimate of exactly this layout (its fullest pipeline stage)."""
    from loom.plan.estimate import Candidate, evaluate

    shape, cluster, wl = planner_inputs(cfg, target, vocab, precision)
    derived, _ = validate(cfg, target.world)
    zero = zero_stage(dims)
    c = Candidate(
        dims.dp,
        dims.tp,
        dims.pp,
        zero,
        derived.micro_batch_size,
        cfg.train.activation_checkpointing,
        n_micro=derived.grad_accum * derived.pp_microbatches,
        replicate=dims.dp_replicate if zero == 3 else 1,
        sp=cfg.parallel.sp,
        cp=dims.cp,
        ep=dims.ep,
    )
    return evaluate(c, cluster, wl)


def layout_flags(c) -> list[str]:
    """loom's overrides for a planner candidate."""
    impl = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}[c.zero]
    flags = [f"--parallel.tp={c.tp}", f"--parallel.pp={c.pp}", f"--parallel.dp_impl={impl}"]
    if c.tp > 1:
        flags.append(f"--parallel.sp={str(c.sp).lower()}")
    if c.replicate > 1:
        flags.append(f"--parallel.dp_replicate={c.replicate}")
    if c.cp > 1:
        flags.append(f"--parallel.cp={c.cp}")
    if c.ep > 1:
        flags.append(f"--parallel.ep={c.ep}")
    return flags + [
        f"--train.micro_batch_size={c.micro_batch}",
        f"--train.activation_checkpointing={c.activation_checkpointing}",
    ]


def next_layouts(
    cfg: Config, cfg_path: str | None, overrides: list[str], target: Target, vocab: int, precision: str
):
    """Layouts to dry-run after cfg's did not fit, each as (its config, its flags), among the planner's that
    loom accepts (config.validate at this world) and that differ from cfg's: the planner's best (its fastest
    that it thinks fits), its best with full recomputation, and the one it thinks needs the least memory. The
    planner's activations run low against loom's (see the dry run's table), so its fastest is often too big."""
    from loom.plan import plan

    shape, cluster, wl = planner_inputs(cfg, target, vocab, precision)
    mine, seen = layout_flags_of(cfg, target), []
    accepted = []
    for c in plan(shape, cluster, wl):
        flags = layout_flags(c)
        try:
            alt = load_config(cfg_path, [*overrides, *flags])
            validate(alt, target.world)
        except LoomError:
            continue
        if flags != mine and (c.pp == 1 or pipeline_supported()):
            accepted.append((c, alt, flags))
    picks = [
        next((a for a in accepted if a[0].fits), None),
        next((a for a in accepted if a[0].fits and a[0].activation_checkpointing == "full"), None),
        min(accepted, key=lambda a: a[0].memory_gb["total"], default=None),
    ]
    for pick in picks:
        if pick is not None and pick[2] not in seen:
            seen.append(pick[2])
            yield pick[1], pick[2]


def layout_flags_of(cfg: Config, target: Target) -> list[str]:
    """cfg's own layout as the flags layout_flags writes."""
    from loom.plan.estimate import Candidate

    derived, dims = validate(cfg, target.world)
    zero = zero_stage(dims)
    c = Candidate(
        dims.dp,
        dims.tp,
        dims.pp,
        zero,
        derived.micro_batch_size,
        cfg.train.activation_checkpointing,
        replicate=dims.dp_replicate if zero == 3 else 1,
        sp=cfg.parallel.sp,
    )
    return layout_flags(c)
