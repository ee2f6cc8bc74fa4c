"""Parallelism applied to a single-device model from outside, in one fixed order (torchtitan's):

    float8 conversion -> tensor parallel -> pipeline split -> activation checkpointing -> compile
    -> FSDP/HSDP -> materialize (the model was built on the meta device) -> DDP or MPI gradient sync

One module per parallelism with generic functions (tensor.py, pipeline.py, ac.py, compile.py, fsdp.py,
ddp.py, zero.py, mpi_dp.py); what names a model's modules comes from the model side: the family's
ParallelPlan (`spec.parallel`, loom/model/registry.py). The trainer holds a `Parallelized` and asks it only
what a step needs.
Adding a parallelism: a module here, its line in `STEPS`, its strategy in loom/verify.py, a test.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from loom import log
from loom.config.layout import ParallelDims
from loom.errors import LoomError
from loom.model.lora import lora_scaling, merge_lora_state
from loom.model.registry import ModelSpec
from loom.optim.build import build_optimizer, param_groups
from loom.parallel import state
from loom.parallel.grads import clip_grad_norm
from loom.parallel.tensor import LocalLoss, align_grads, local, loss_context


class Parallelized:
    """The model parts of this rank and the few things a training step asks of the layout."""

    def __init__(self, model: nn.Module, dims: ParallelDims, device: torch.device, spec: ModelSpec):
        self.model, self.dims, self.device, self.spec = model, dims, device, spec
        plan = self.plan = spec.parallel
        self.forward: nn.Module = model  # what a micro-step calls: DDP's wrapper, the TP loss wrapper, ...
        self.pipeline = None  # loom.parallel.pipeline.Pipeline when pp > 1
        self.fsdp_roots: list[nn.Module] = []
        self.grad_sync = None  # MPI's gradient synchroniser (loom.parallel.mpi_dp)
        self.fp8: list[str] = []  # the linears converted to float8 (loom.parallel.fp8)
        self.fp8_gather = False  # FSDP all-gathers their weights in float8 (scales precomputed each step)
        self.tied_group = None  # pp: the first and last stage's group, for the tied embedding/head
        self.expert_layers: list[nn.Module] = []  # ep: the MoE layers whose experts are split
        self.ep_mesh = None  # ep: the (pp, efsdp, ep, tp) mesh
        self.expert_sync = False  # ep: expert gradients made the mean over the data ranks (parallel.expert)
        self.sync_bytes = (
            None  # DDP: what each step hands the gradient all-reduce (loom.parallel.ddp.SyncBytes)
        )
        self.diloco = None  # parallel.diloco_inner_steps: the outer loop (loom.parallel.diloco.DiLoCo)
        # the straggler monitor's waits for peers: DDP's buckets (distributed.stragglers.BucketWaits), FSDP's and
        # the pipeline's blocked collectives (BlockedWaits)
        self.bucket_waits = None
        self.tied: dict[str, str] = plan.tied(model)  # alias -> canonical name of one tensor ({}: untied)
        # the single-device model's names, for checkpoints: state-dict keys and the optimizer's order
        self.names = list(model.state_dict().keys())
        ids = {id(p): n for n, p in model.named_parameters()}
        self.order = [[ids[id(p)] for p in g["params"]] for g in param_groups(model, 0.0)]

    # ----------------------------------------------------------------------------- a step
    def no_sync(self, skip: bool):
        """Within it, backward accumulates gradients without communicating (all micro-steps but the last); FSDP
        that shards still reduce-scatters every micro-step (loom.parallel.fsdp.set_gradient_sync says why)."""
        if self.fsdp_roots:
            from loom.parallel.fsdp import set_gradient_sync

            set_gradient_sync(self.fsdp_roots, last=not skip, sharded=self.dims.fsdp_shard > 1)
        elif skip and self.grad_sync is not None:
            return self.grad_sync.no_sync()
        elif skip and hasattr(self.forward, "no_sync"):
            return self.forward.no_sync()
        return contextlib.nullcontext()

    def loss_context(self):
        return loss_context(self.dims.tp_enabled and not self.dims.pp_enabled)

    def sync_grads(self) -> None:
        """After the last backward of a step: what the wrappers do not do during backward."""
        if self.grad_sync is not None:
            self.grad_sync.sync()
        if self.expert_sync:
            from loom.parallel.expert import sync_expert_grads

            sync_expert_grads(
                self.expert_params(), self.ep_mesh, self.dims.dp * self.dims.cp, bool(self.fsdp_roots)
            )
        if self.dims.tp_enabled:
            align_grads(self.model.parameters())
        if self.dims.pp_enabled and self.tied_group is not None:
            # A tied pair (embedding/head) on the first and the last stage: their gradients are two halves of one.
            tied = set(self.tied) | set(self.tied.values())
            for name, w in self.model.named_parameters():
                if name in tied and w.grad is not None:
                    with self.blocked():
                        dist.all_reduce(local(w.grad), group=self.tied_group)

    def blocked(self):
        """Around a blocking collective of the step outside the schedule and FSDP's comms (the pipeline's tied
        pair, the gradient norm's all-reduce under FSDP or the pipeline): the time this rank waits in it for a
        peer is the straggler monitor's `wait` (BlockedWaits), not its phase's own time; else nothing. A stage
        stopped there shows it as its own (`stalled`), where before both stages showed it alike in `comm` or
        `other` and a slow stage hid."""
        return getattr(self.bucket_waits, "blocked", contextlib.nullcontext)()

    def after_update(self, step: int) -> dict:
        """After optimizer step `step`: DiLoCo's outer step when due; the bytes this rank all-reduced for the
        step (allreduce_bytes: DDP's gradients, outer_bytes: DiLoCo's parameter change), for metrics.jsonl."""
        rec = {}
        if self.sync_bytes is not None:
            rec["allreduce_bytes"] = self.sync_bytes.take()
        if self.diloco is not None and self.diloco.due(step):
            rec.update(outer_step=step // self.diloco.h, outer_bytes=self.diloco.outer_step())
        return rec

    def replicas_equal(self, step: int) -> bool:
        """Every replica holds the same parameters after `step` (false between DiLoCo's outer steps: no
        checkpoint can be written there)."""
        return self.diloco is None or self.diloco.due(step)

    def expert_params(self) -> list[nn.Parameter]:
        """The experts' weights now (FSDP and materialization replace parameter objects)."""
        return [w for moe in self.expert_layers for w in moe.experts.parameters()]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # the tied pair counts twice only where two stages hold it (not with one stage: pp at degree 1)
        shared = set(self.tied) | set(self.tied.values()) if self.tied_group is not None else set()
        return clip_grad_norm(self.model, max_norm, self.dims, shared, self.blocked)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """A sum over every rank of the job, on the job's device (losses, eval sums)."""
        if self.grad_sync is not None:
            return self.grad_sync.all_reduce_sum(t)
        if self.dims.world_size == 1:
            return t
        t = t.detach().clone()
        dist.all_reduce(t)
        return t

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over data-parallel replicas of the loss (only the last pipeline stage has one)."""
        holds = not self.dims.pp_enabled or self.pipeline.holds_last
        total = self.all_reduce_sum(loss if holds else torch.zeros_like(loss))
        return total / (self.dims.dp * self.dims.cp * self.dims.tp)  # cp ranks: means of equal token counts

    def after_step(self, update: bool) -> dict:
        """The family's work after an optimizer step (its spec's `after_step`: a MoE moves its balance bias by
        the global batch's expert load), and the figures it reports for metrics.jsonl."""
        return self.spec.after_step(self.model, self.all_reduce_sum, update)

    def refresh_fp8_scales(self) -> None:
        """FSDP's float8 all-gather: the weight scales of the next forward, from the weights as they are now
        (one all-reduce). After each optimizer step, and once before the first step (a resumed run then
        gathers with scales computed the same way as the run it continues)."""
        if self.fp8_gather:
            from loom.parallel.fp8 import precompute_scales

            precompute_scales(self.model)

    def high_precision(self):
        """Evaluation, sampling: the float8 linears compute in high precision (loom.parallel.fp8)."""
        if not self.fp8:
            return contextlib.nullcontext()
        from loom.parallel.fp8 import high_precision

        return high_precision(self.model)

    def build_optimizer(self, ocfg) -> torch.optim.Optimizer:
        if self.dims.dp_impl == "zero1" and self.dims.dp_enabled:
            from loom.parallel.zero import build_zero1_optimizer

            return build_zero1_optimizer(self.model, ocfg, self.device)
        if ocfg.name == "muon":  # one code path for every layout (DTensors: loom.optim.muon.orthogonalize)
            return build_optimizer(self.model, ocfg, self.device)
        impl = ocfg.impl
        if (self.dims.tp_enabled and not self.fsdp_roots) or self.dims.ep_enabled:
            # foreach/fused want one kind of tensor per list: TP mixes DTensors and tensors, EP DTensors of
            # two meshes (experts over (efsdp, ep), the rest over the data-parallel ranks)
            impl = "torch-loop"
        elif self.fsdp_roots and impl in ("auto", "torch-fused"):
            impl = "torch-foreach"  # fused AdamW does not take DTensor parameters on every device
        if impl != ocfg.impl and ocfg.impl != "auto":
            log.warn(f"optim.impl={ocfg.impl} does not take this layout's parameters; using {impl}")
        return build_optimizer(self.model, replace(ocfg, impl=impl), self.device)

    # ----------------------------------------------------------------------------- eval and sampling
    def eval_model(self) -> nn.Module:
        """The module validation calls: the unwrapped model, unless the wrapper is what makes it work (TP)."""
        return self.model if isinstance(self.forward, nn.parallel.DistributedDataParallel) else self.forward

    def sampling_model(self) -> nn.Module | None:
        """The model this rank samples with, or None (called on every rank; a collective when the model is
        split). A whole model samples itself on rank 0. A split one (tensor, pipeline, FSDP/ZeRO-2) is gathered
        once into a whole single-device copy on rank 0 while the other ranks wait: a sharded forward per token
        would all-gather every block for every token on every rank (a 43M model's 200-token sample on 4 CPU
        ranks: 105 s that way, 15-19 s this way: benchmarks/fsdp_cpu_memory.py)."""
        if not (self.dims.model_parallel or self.fsdp_roots or self.dims.cp_enabled or self.dims.ep_enabled):
            return self.model if self.dims.is_main else None
        sd = self.model_state()
        if not self.dims.is_main:
            return None
        with torch.device("meta"):
            whole = self.spec.build(self.model.cfg)
        scaling = lora_scaling(self.model)
        if scaling is not None:  # LoRA: the copy samples with the adapters merged into its weights
            sd = merge_lora_state(sd, scaling)
        whole.load_state_dict(sd, assign=True)
        self.plan.retie(whole)
        return whole.to(self.device)

    # ----------------------------------------------------------------------------- checkpoint state
    def model_state(self) -> dict:
        return state.model_state(self.model, self.dims, self.names, self.tied)

    def load_model_state(self, sd: dict) -> None:
        state.load_model_state(self.model, sd, self.tied)
        if self.diloco is not None:
            self.diloco.reanchor()

    def sharded_state(self, opt) -> tuple[dict, dict]:
        """(model, optimizer) state of this rank's pieces under single-device names, for DCP (nothing gathered);
        DiLoCo: its momentum, and each replica's inner optimizer state under its own prefix."""
        from loom.parallel import dcp_state

        tied, d = self.tied, self.diloco
        optim = dcp_state.optim_shards(self.model, opt, tied, d.inner_prefix if d else "")
        if d is not None:
            optim.update(d.momentum_state())
        if self.sync_bytes is not None and self.sync_bytes.hook_state is not None:  # PowerSGD's, this rank's
            optim.update(self.sync_bytes.hook_state.state_dict())
        return dcp_state.model_shards(self.model, tied), optim

    def load_sharded(self, opt, model_dir, optim_dir=None) -> None:
        """Load DCP folders written under any layout into this rank's pieces (optimizer: when given)."""
        from loom.parallel import dcp_state

        d = self.diloco
        dcp_state.load_model_shards(self.model, model_dir, self.tied)
        if optim_dir is not None:
            dcp_state.load_optim_shards(self.model, opt, optim_dir, self.tied, d.inner_prefix if d else "")
        if d is not None:
            d.reanchor()
            momentum = d.momentum_state()
            if optim_dir is not None and set(momentum) <= set(dcp_state.saved_keys(optim_dir)):
                dcp_state.load_into(momentum, optim_dir, "optimizer")  # (a plain checkpoint: momentum 0)
        hook = self.sync_bytes.hook_state if self.sync_bytes is not None else None
        if optim_dir is not None and hook is not None:  # PowerSGD: a checkpoint without it warms up again
            sd = hook.expected(dcp_state.saved_keys(optim_dir))
            if sd:  # every rank or none (a rule of the saved keys alike on all): DCP's load is collective
                dcp_state.load_into(sd, optim_dir, "optimizer")
                hook.load_state_dict(sd)

    def load_optim_state(self, opt, sd: dict) -> None:
        if self.dims.dp_impl == "zero1" and self.dims.dp_enabled:
            opt.load_state_dict(sd)
        else:
            state.load_optim_state(self.model, opt, sd, self.order, self.tied)


@dataclass
class _Work:
    """parallelize's work in progress: the job's values each step reads, and what the steps before it left."""

    model: nn.Module
    dims: ParallelDims
    cfg: Any  # the run's loom Config
    device: torch.device
    plan: Any  # the family's ParallelPlan (spec.parallel)
    par: Parallelized
    precision: str
    n_microbatches: int
    init: Callable | None
    mesh: Any = None  # the device mesh (None: a layout of plain data parallelism, or one process)
    fsdp: bool = False  # FSDP (or HSDP) wraps the model: sharded data parallelism, or DP beside TP/PP
    roots: list = field(default_factory=list)  # this rank's model parts: the model, or its pipeline stages
    stages: tuple = ()  # pipeline parallel: (this rank's stage ids, the number of stages)
    blocks: list = field(default_factory=list)  # the roots' blocks, as activation checkpointing wrapped them
    groups: tuple = (None, None)  # DiLoCo: (this replica's ranks, this piece's ranks across replicas)


def _float8(w: _Work) -> None:
    from loom.parallel.fp8 import convert

    w.par.fp8 = convert(w.model, w.cfg.precision, w.fsdp)
    w.par.fp8_gather = w.fsdp and w.cfg.precision.fp8 == "tensorwise"


def _tensor(w: _Work) -> None:
    from loom.parallel.tensor import apply_tp

    model, dims, plan = w.model, w.dims, w.plan
    tp_plan = plan.tp_plan(model, dims.tp, w.cfg.parallel.sp, loss_parallel=not dims.pp_enabled)
    if w.par.fp8:
        from loom.parallel.fp8 import tp_styles

        tp_plan = tp_styles(model, tp_plan, w.cfg.precision.fp8)
    if lora_scaling(model) is not None:  # LoRA: the adapters split as their linears' weights (Megatron's)
        from loom.parallel.lora import lora_tp_styles

        tp_plan = lora_tp_styles(model, tp_plan)
    frozen = {n for n, q in model.named_parameters() if not q.requires_grad}
    apply_tp(model, w.mesh["tp"], tp_plan)
    plan.retie(model)
    for n, q in model.named_parameters():  # torch's SequenceParallel makes its norms' gains trainable again
        if n in frozen:
            q.requires_grad_(False)


def _context(w: _Work) -> None:
    """Context parallel: ring attention in the family's `attn.context` slot, or Ulysses' all-to-alls around
    q/k/v/o; the family's position table (ModelSpec.position_table; None: RoPE) offset to this rank's chunk."""
    spec, group = w.par.spec, w.mesh["cp"].get_group()
    if w.cfg.parallel.cp_impl == "ring":
        from loom.parallel.ring import Ring, apply_ring

        if not spec.ring_attention:
            raise LoomError(
                f"parallel.cp_impl=ring needs an attention with a `context` slot; model.family={spec.name} has none",
                hint="use parallel.cp_impl=ulysses (it hooks only q/k/v/o_proj)",
            )
        apply_ring(w.model, w.plan.blocks(w.model), Ring(group), spec.position_table(w.model))
    else:
        from loom.parallel.context import apply_ulysses

        wpe, doc_mask = spec.position_table(w.model), w.cfg.data.doc_mask
        apply_ulysses(w.model, w.plan.blocks(w.model), group, w.dims.cp_rank, wpe, doc_mask)


def _expert(w: _Work) -> None:
    """The experts split over ep of the data-parallel x cp ranks (the family names them)."""
    from loom.parallel.expert import apply_ep, build_ep_mesh

    w.par.ep_mesh = build_ep_mesh(w.dims, w.device.type)
    w.par.expert_layers = w.par.spec.expert_layers(w.model)
    apply_ep(w.par.expert_layers, w.par.ep_mesh)


def _pipeline_split(w: _Work) -> None:
    from loom.parallel.pipeline import stage_ids

    ids, n_stages = stage_ids(w.cfg.parallel.pp_schedule, w.dims.pp, w.dims.pp_rank)
    w.stages = (ids, n_stages)
    w.roots = w.plan.split_stages(w.model, ids, n_stages)


def _checkpointing(w: _Work) -> None:
    from loom.parallel.ac import apply_ac

    w.blocks = [b for root in w.roots for b in w.plan.blocks(root)]
    apply_ac(w.blocks, w.cfg.train.activation_checkpointing)


def _compile(w: _Work) -> None:
    from loom.parallel.compile import apply_compile

    apply_compile(w.blocks)


def _fsdp(w: _Work) -> None:
    from loom.parallel.fsdp import apply_fsdp, mp_policy

    p, dims = w.cfg.parallel, w.dims
    # the cp ranks of a data-parallel rank hold the same parameters: FSDP shards over dp_shard x cp
    shard = "dp_shard_cp" if dims.cp_enabled else "dp_shard"
    with warnings.catch_warnings():  # torch 2.13 plans to stop slicing flattened dims; 2.11-2.13 need it
        warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
        # DiLoCo: FSDP within a replica; the replicas meet in the outer step (loom.parallel.diloco)
    dp_mesh = w.mesh[shard] if dims.dp_replicate == 1 or dims.diloco else w.mesh["dp_replicate", shard]
    # zero2 and replicas keep gathered parameters
    reshard = dims.dp_impl == "fsdp" and dims.fsdp_shard > 1
    mp = mp_policy(p.param_dtype, p.reduce_dtype, w.device, w.precision)
    if dims.ep_enabled:  # first: the blocks' and roots' FSDP then leave the experts' weights alone
        from loom.parallel.expert import shard_experts

        layers = [m for root in w.roots for m in w.par.spec.expert_layers(root)]  # this rank's stages
        shard_experts(layers, w.par.ep_mesh, reshard_after_forward=reshard, mp_policy=mp)
        w.par.expert_sync = True
    apply_fsdp(w.roots, w.plan.blocks, dp_mesh, reshard, mp, p.cpu_offload, w.device)
    w.par.fsdp_roots = w.roots


def _materialize(w: _Work) -> None:
    from loom.parallel.init import materialize

    materialize(w.model, w.device, w.init, w.par.tied)
    w.plan.retie(w.model)  # to_empty gave each module of a tied pair its own new tensor


def _pipeline(w: _Work) -> None:
    from loom.parallel.pipeline import Pipeline

    p, dims, par = w.cfg.parallel, w.dims, w.par
    group = w.mesh["pp"].get_group()
    par.pipeline = Pipeline(w.roots, *w.stages, group, w.device, p.pp_schedule, w.n_microbatches)
    par.tied_group = _first_last_group(dims) if dims.pp > 1 and par.tied else None  # 1 stage: whole pair


def _tp_loss(w: _Work) -> None:
    w.par.forward = LocalLoss(w.model)


def _ddp(w: _Work) -> None:
    from loom.distributed.stragglers import BucketWaits
    from loom.parallel.ddp import apply_compression, apply_ddp

    model, p = w.model, w.cfg.parallel
    ignore = {id(q) for q in w.par.expert_params()}
    names = [n for n, q in model.named_parameters() if id(q) in ignore]
    group = w.groups[0] if w.dims.diloco else None  # DiLoCo: DDP within a replica
    ddp = w.par.forward = apply_ddp(model, w.device, names, group)
    w.par.expert_sync = bool(ignore)
    if w.cfg.train.straggler_every and w.dims.world_size > 1:  # the straggler monitor times DDP's waits
        w.par.bucket_waits = BucketWaits(w.device)
    w.par.sync_bytes = apply_compression(
        ddp, p.grad_compression, p.powersgd_rank, p.powersgd_warmup, w.par.bucket_waits
    )


def _blocked_waits(w: _Work) -> None:
    """The straggler monitor's waits for peers inside FSDP's all-gathers and reduce-scatters and the pipeline's
    sends and receives (loom.distributed.stragglers.BlockedWaits; the collectives themselves unchanged)."""
    from torch.distributed.fsdp import FSDPModule

    from loom.distributed.stragglers import BlockedWaits, timed_fsdp, timed_pipeline

    waits = BlockedWaits()
    fsdp = [m for root in w.roots for m in root.modules() if isinstance(m, FSDPModule)]
    if (not w.fsdp or timed_fsdp(fsdp, waits)) and (not w.dims.pp_enabled or timed_pipeline(waits)):
        w.par.bucket_waits = waits


def _waits_seen(w: _Work) -> bool:
    """Every collective a step waits in is one _blocked_waits times: FSDP (HSDP's all-reduce across replicas
    too) and the pipeline, without tensor, context or expert parallel, on the host clock (on a GPU the host
    does not block in them: loom.distributed.stragglers)."""
    from loom import device as dev

    d = w.dims
    return (
        bool(w.cfg.train.straggler_every)
        and d.world_size > 1
        and (w.fsdp or d.pp_enabled)
        and not (d.tp_enabled or d.cp_enabled or d.ep_enabled)
        and not dev.Span(w.device).events
    )


def _diloco_groups(w: _Work) -> None:
    from loom.parallel.diloco import replica_groups

    w.groups = replica_groups(w.dims, w.mesh if w.fsdp else None)


def _diloco(w: _Work) -> None:
    from loom.parallel.diloco import DiLoCo

    p = w.cfg.parallel
    w.par.diloco = DiLoCo(
        w.model,
        w.dims,
        w.groups[1],
        p.diloco_inner_steps,
        p.diloco_outer_lr,
        p.diloco_outer_momentum,
        w.par.tied,
    )


def _mpi(w: _Work) -> None:
    from loom.parallel.mpi_dp import BucketedSync, NaiveSync, mpi_comm

    p, comm = w.cfg.parallel, mpi_comm()
    sync = (
        NaiveSync(w.model, comm)
        if p.mpi_sync == "naive"
        else BucketedSync(w.model, comm, p.bucket_mb, p.mpi_allreduce)
    )
    w.par.grad_sync = sync


def _wraps_forward(w: _Work) -> bool:
    """The last steps are one choice: the pipeline's schedule, else TP's loss wrapper, else DDP or MPI."""
    return w.dims.pp_enabled or w.dims.tp_enabled


# Each step of the fixed order (torchtitan's), with the condition under which it applies; read top to bottom
# it is the layout's recipe. Adding a parallelism: a module here and its line in this list.
STEPS: list[tuple[str, Callable[[_Work], bool], Callable[[_Work], None]]] = [
    ("float8", lambda w: w.cfg.precision.fp8 != "off", _float8),
    ("tensor parallel", lambda w: w.dims.tp_enabled, _tensor),
    ("context parallel", lambda w: w.dims.cp_enabled, _context),
    ("expert parallel", lambda w: w.dims.ep_enabled, _expert),
    ("pipeline split", lambda w: w.dims.pp_enabled, _pipeline_split),
    ("activation checkpointing", lambda w: True, _checkpointing),  # apply_ac reads the policy ("none" too)
    ("compile", lambda w: w.cfg.train.compile, _compile),
    ("FSDP", lambda w: w.fsdp, _fsdp),
    ("DiLoCo groups", lambda w: w.dims.diloco, _diloco_groups),
    ("materialize", lambda w: any(q.is_meta for q in w.model.parameters()), _materialize),
    ("pipeline schedule", lambda w: w.dims.pp_enabled, _pipeline),
    ("TP loss", lambda w: w.dims.tp_enabled and not w.dims.pp_enabled, _tp_loss),
    (
        "DDP",
        # the cp ranks average gradients too
        lambda w: (
            not _wraps_forward(w)
            and w.dims.dp_impl in ("ddp", "zero1")
            and (w.dims.dp_enabled or w.dims.cp_enabled)
        ),
        _ddp,
    ),
    ("MPI", lambda w: not _wraps_forward(w) and w.dims.dp_impl == "mpi", _mpi),
    ("DiLoCo", lambda w: w.dims.diloco, _diloco),  # last: it holds the parameter objects FSDP made
    ("straggler waits", _waits_seen, _blocked_waits),  # DDP's are timed in its comm hook (_ddp)
]


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    cfg,
    device: torch.device,
    spec: ModelSpec,
    *,
    precision: str = "fp32",
    n_microbatches: int = 1,
    init=None,
) -> Parallelized:
    """Apply the layout `dims` to `model` (built on the meta device, or already materialized) in the fixed
    order of STEPS, asking the family's plan (spec.parallel) what to split, cut and wrap; `init(name,
    whole_tensor)` gives a meta-built parameter its initial values (loom.parallel.init)."""
    par = Parallelized(model, dims, device, spec)
    w = _Work(model, dims, cfg, device, spec.parallel, par, precision, n_microbatches, init, roots=[model])
    if dims.model_parallel or dims.fsdp_enabled or dims.cp_enabled:
        w.mesh = dims.build_mesh(device.type)
    w.fsdp = dims.fsdp_enabled or (dims.model_parallel and (dims.dp_enabled or dims.cp_enabled))
    for _name, applies, apply in STEPS:
        if applies(w):
            apply(w)
    return par


def _first_last_group(dims: ParallelDims):
    """The group of the first and last pipeline stage with this rank's dp and tp coordinates (every rank
    creates every group, in the same order, as torch.distributed requires)."""
    mine, per_stage = None, dims.dp * dims.cp * dims.tp
    for k in range(per_stage):
        ranks = [s * per_stage + k for s in (0, dims.pp - 1)]
        group = dist.new_group(ranks)
        if dims.rank in ranks:
            mine = group
    return mine
