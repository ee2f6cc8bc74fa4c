"""One rank of the job, built through loom's real path and trained for one step under torch's memory tracker.

The family's model on the meta device (`spec.build_model`), the real `loom.parallel.parallelize` with this
rank's layout, its optimizer (`Parallelized.build_optimizer`), then one optimizer step as the trainer takes it
(loom.train.trainer.Trainer.train_step): the micro-batches with gradient accumulation (or the pipeline
schedule's step), activation checkpointing as configured, the gradient sync, the non-finite check, the clip and
the optimizer update. What is reported is a steady step's (the second of a run and every one after): the
optimizer state the first update creates is counted as held through forward and backward (_steady).
Parameters are not initialised: their values change nothing that is measured.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from loom import compat
from loom.config import Config, Derived, validate
from loom.dryrun import fake
from loom.dryrun import torchao_states as torchao
from loom.metrics import DTYPES
from loom.model.registry import spec_of
from loom.parallel.offload import ActivationOffload, stays_on_device

DEVICE = torch.device("cpu")  # the fake tensors' device: loom.dryrun's docstring says why not "cuda"


@dataclass
class RankMemory:
    """Bytes one rank holds and peaks at. `params`, `grads`, `optim`: held after the step (before zero_grad),
    counted as the trainer counts them for metrics.jsonl (loom.parallel.state.model_state_bytes: local shards,
    optimizer tensors of dim >= 1). `phases`: for each phase of the step (forward with the head's backward,
    the blocks' backward, or a pipeline's warm-up and 1F1B part; sync/clip; update), the tracker's terms at
    its peak (loom.dryrun.fake.TERMS, 'total'), as in a steady step (_steady). `tracked`: the tracker's terms after the step. `ddp_buckets`: DDP's
    gradient buckets, which no step allocates (they are made with the wrapper), added to every peak."""

    rank: int
    pp_rank: int
    tp_rank: int
    stages: list[int]
    params: int
    grads: int
    optim: int
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    tracked: dict[str, int] = field(default_factory=dict)
    ddp_buckets: int = 0
    offloaded: int = 0  # train.activation_offload: bytes of saved activations kept in host memory per step
    host_optim: int = 0  # optim.offload=cpu: the optimizer state and fp32 parameter copy in host memory
    seconds: float = 0.0
    blocks: int = 0  # transformer blocks this rank holds
    measured_blocks: list[int] = field(default_factory=list)  # [] all stepped; [3, 4]: the line through those
    measured_microbatches: list[int] = field(default_factory=list)  # pipeline micro-batches, likewise
    stands_for: list[int] = field(default_factory=list)  # the pipeline ranks whose memory this rank's bounds

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p]["total"])

    @property
    def at_peak(self) -> dict[str, int]:
        """The terms at the step's peak (DDP's buckets in 'gathered' and 'total')."""
        at = dict(self.phases[self.peak_phase])
        at["gathered"] += self.ddp_buckets
        at["total"] += self.ddp_buckets
        return at

    @property
    def peak(self) -> int:
        return self.at_peak["total"]

    @property
    def act_peak(self) -> int:
        """Activations (saved ones, backward temporaries, the batch) at the step's peak."""
        return self.at_peak["activations"]

    def as_dict(self) -> dict:
        return {
            **vars(self),
            "peak": self.peak,
            "peak_phase": self.peak_phase,
            "at_peak": self.at_peak,
            "act_peak": self.act_peak,
        }


def measure_rank(
    cfg: Config, world: int, rank: int, vocab_size: int, precision: str, n_microbatches: int | None = None
) -> RankMemory:
    """Rank `rank` of a `world`-rank job of `cfg`, trained one step on fake tensors: what it holds and its peak.
    n_microbatches: the pipeline schedule's micro-batches, if not the job's (loom.dryrun.blocks)."""
    from loom.parallel import parallelize
    from loom.parallel.pipeline import stage_ids
    from loom.parallel.state import model_state_bytes

    t0 = time.perf_counter()
    derived, dims = validate(cfg, world, rank)
    asked, cfg = cfg, torchao.stepped_config(cfg)  # NF4 / low-bit states / offload: stepped off, then counted
    n_mb = n_microbatches or derived.pp_microbatches
    spec = spec_of(cfg)
    mode, ddp = fake.fake_mode(), fake.DdpBuckets()
    with fake.fake_world(world, rank):
        model = spec.build_model(cfg, vocab_size, "meta", eot_id=eot_id(cfg, vocab_size))
        finetune(model, cfg, vocab_size)
        with fake.parallelize_fake(mode, ddp):
            par = parallelize(
                model,
                dims,
                cfg,
                DEVICE,
                spec,
                precision=precision,
                n_microbatches=n_mb,
                init=None,
            )
        with mode, fake.gpu_paths():
            opt = par.build_optimizer(cfg.optim)
            if par.pipeline is not None:
                ids, n_stages = stage_ids(cfg.parallel.pp_schedule, dims.pp, dims.pp_rank)
                examples = _stage_examples(cfg, model.cfg, derived, par, ids, n_stages, precision)
                fake.static_pipeline(par.pipeline, *examples)
            else:
                ids = [0]
            tracker = fake.FSDPStepTracker(par.fsdp_roots, opt) if par.fsdp_roots else fake.StepTracker()
            if not par.fsdp_roots:
                tracker.track_external(par.model, opt)
            rows = derived.micro_batch_size * derived.grad_accum * n_mb
            seq = cfg.model.block_size // dims.cp  # context parallel: each rank its chunk of each sequence
            x = torch.randint(0, vocab_size, (rows, seq), device=DEVICE)
            y = torch.randint(0, vocab_size, (rows, seq), device=DEVICE)
            offload = _FakeOffload(DEVICE, cfg.train.activation_offload)
            with tracker:
                loss_sum = _forward_backward(par, x, y, derived, _autocast(precision), tracker, offload)
                _sync_and_clip(par, loss_sum, cfg.optim.grad_clip or math.inf)
                tracker.mark("sync/clip")
                with _local_shards(opt):
                    opt.step()
                tracker.mark("update")
                after = fake.terms(tracker.get_tracker_snapshot())
            held = model_state_bytes(par.model, opt)
    phases = _steady(tracker.phases, after["optim"])
    mem = RankMemory(
        rank,
        dims.pp_rank,
        dims.tp_rank,
        ids,
        held["params"],
        held["grads"],
        held["optim"],
        phases=phases,
        tracked=after,
        ddp_buckets=ddp.bytes,
        offloaded=offload.saved_bytes,
        seconds=time.perf_counter() - t0,
    )
    return torchao.rewrite(mem, par.model, asked) if torchao.counted(asked) else mem


def finetune(model, cfg: Config, vocab_size: int) -> None:
    """finetune.* as the trainer applies it (LoRA adapters, the base frozen: no gradient or optimizer state
    for it), with the data's meta when data.path names it (whether chat tokens make the embedding train)."""
    if not cfg.finetune.lora_rank:
        return
    from loom.train.finetune import apply_finetune

    meta = {"vocab_size": vocab_size}
    from loom.data.mix import data_path

    if path := data_path(cfg.data):  # data.path, or data.mix's first source
        from loom.data.loader import read_meta

        meta = read_meta(path)
    apply_finetune(model, cfg, meta)


def _autocast(precision: str):
    if precision == "fp32":
        return contextlib.nullcontext
    return lambda: torch.autocast(DEVICE.type, dtype=DTYPES[precision])


def eot_id(cfg: Config, vocab_size: int) -> int | None:
    """data.doc_mask's end-of-text id: any id will do (what is measured does not depend on which)."""
    return vocab_size - 1 if cfg.data.doc_mask else None


def _steady(phases: dict[str, dict[str, int]], state: int) -> dict[str, dict[str, int]]:
    """The phases of a step after a run's first. The optimizer creates its state (AdamW's m and v) in the first
    update; from the second step on it is held through every phase before the update too. The update's own
    peak is the same in every step (the state exists while it runs)."""
    return {
        name: ph if name == "update" else {**ph, "optim": ph["optim"] + state, "total": ph["total"] + state}
        for name, ph in phases.items()
    }


@contextlib.contextmanager
def _local_shards(opt):
    """A torch.optim optimizer updates this rank's local shards for the duration, instead of the DTensors that
    hold them. DTensor runs each of the optimizer's (foreach) ops as the same op on the local shards, so the
    allocations are the same; what is saved is DTensor's sharding propagation for lists of hundreds of
    tensors, most of a fake update's time. Other optimizers (Muon, which gathers whole matrices; ZeRO-1's
    wrapper) update what they were given."""
    from loom.parallel.tensor import is_dtensor

    if not type(opt).__module__.startswith("torch.optim") or not any(
        is_dtensor(p) for g in opt.param_groups for p in g["params"]
    ):
        yield
        return
    saved = [g["params"] for g in opt.param_groups]
    with torch.no_grad():
        for g in opt.param_groups:
            g["params"] = [_local_param(p) if is_dtensor(p) else p for p in g["params"]]
    try:
        yield
    finally:
        for g, params in zip(opt.param_groups, saved, strict=True):
            g["params"] = params


def _local_param(p: torch.Tensor) -> torch.nn.Parameter:
    """A parameter on p's local shard (the same storage), its gradient p's local gradient."""
    local = torch.nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
    if p.grad is not None:
        local.grad = p.grad.to_local()
    return local


def micro_steps(accum: int) -> list[int]:
    """The micro-steps of gradient accumulation the dry run runs: the first, the second and the last. Those
    between repeat the second's allocations exactly (the same shapes, the accumulated gradients already
    allocated: sharded ones under FSDP, which reduce-scatters every micro-step, whole local ones otherwise), so
    the step's peak is the same."""
    return list(range(accum)) if accum <= 3 else [0, 1, accum - 1]


class _FakeOffload(ActivationOffload):
    """train.activation_offload on fake tensors, which hold no values: a saved activation is dropped when
    packed (the device memory the real hooks free after their copy to the host) and an empty one is made when
    the backward unpacks it (the copy back), so the tracker sees the device memory of the real hooks."""

    def _pack(self, t: torch.Tensor):
        if stays_on_device(t):
            return t
        self.saved_bytes += t.numel() * t.element_size()
        return t.size(), t.dtype, t.device

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        size, dtype, device = packed
        return torch.empty(size, dtype=dtype, device=device)


def _forward_backward(par, x, y, derived: Derived, autocast, tracker, offload) -> torch.Tensor:
    """Trainer.train_step's forward and backward: the micro-batches (micro_steps) with gradient accumulation,
    or the pipeline schedule's step; without the data loader, timers, fault hooks and host reads (fake tensors
    hold no values). fp16's loss scaling is left out (in place)."""
    accum = derived.grad_accum
    if par.pipeline is not None:
        with _marked_first_backward(par.pipeline, tracker), offload():
            loss_sum = par.pipeline.step(x, y, autocast)
        tracker.mark("1F1B and cool-down")
        return loss_sum
    loss_sum = torch.zeros((), device=DEVICE)
    chunks = list(zip(x.chunk(accum), y.chunk(accum), strict=True))
    blocks = par.plan.blocks(par.model)
    # The backward pass peaks at one of two moments: the head's backward (every block's activations held, the
    # loss's temporaries) or the end (the root's gradients reduced). Which one wins can change with the number
    # of blocks (the first grows with each, the second does not), so each is a phase of its own: what
    # loom.dryrun.blocks extends along its line is each moment's peak.
    hook = blocks[-1].register_full_backward_pre_hook(lambda *_: tracker.mark("forward, head backward"))
    try:
        for i in micro_steps(accum):
            xm, ym = chunks[i]
            with par.no_sync(skip=i < accum - 1), par.loss_context():
                with autocast(), offload():
                    loss = par.forward(xm, ym) / accum
                loss.backward()
            tracker.mark("block backward")
            loss_sum += loss.detach()
    finally:
        hook.remove()
    return loss_sum


@contextlib.contextmanager
def _marked_first_backward(pipeline, tracker):
    """A pipeline step's warm-up (its forwards up to the first backward) is a phase of its own: the step peaks
    either there (the in-flight micro-batches' activations) or in the backwards that follow (the same, with
    FSDP's unsharded parameters and accumulated gradients held from the first backward on: torch's stage skips
    the reshard and the reduce-scatter until the last), and which one wins can change with the number of blocks.
    Each phase's peak is at the same moment for any number of blocks and micro-batches: each extends along its
    line (loom.dryrun.blocks)."""
    schedule = pipeline.schedule
    stages = compat.pipeline_stages(schedule)
    first = []

    def wrap(backward):
        def marked(*args, **kwargs):
            if not first:
                first.append(True)
                tracker.mark("warm-up")
            return backward(*args, **kwargs)

        return marked

    saved = [stage.backward_one_chunk for stage in stages]
    for stage in stages:
        stage.backward_one_chunk = wrap(stage.backward_one_chunk)
    try:
        yield
    finally:
        for stage, backward in zip(stages, saved, strict=True):
            stage.backward_one_chunk = backward


def _sync_and_clip(par, loss_sum: torch.Tensor, max_norm: float) -> None:
    """What the trainer does between the last backward and the update: the gradient sync, the non-finite check,
    the clip and the loss all-reduce."""
    from loom.train.guard import grad_flags

    par.sync_grads()
    grad_flags(par.model)
    norm = par.clip_grad_norm(max_norm)
    torch.stack([par.mean_loss(loss_sum).float(), norm.float()])


def _stage_examples(cfg: Config, mcfg, derived: Derived, par, ids: list[int], n_stages: int, precision: str):
    """Example input and output tensors of each of this rank's pipeline stages (loom's stage contract,
    as the built-in families' Stage keeps it: token ids into the first, hidden states between, logits out of the last).
    Hidden states are in the compute dtype (FSDP's param_dtype, which FSDP casts each stage's input to, else
    the parameters' fp32) and sequence-sharded with sequence parallel; logits in autocast's dtype."""
    mb, T = derived.micro_batch_size, cfg.model.block_size
    p = cfg.parallel
    compute = DTYPES[p.param_dtype] if par.fsdp_roots and p.param_dtype else torch.float32
    logits = compute if precision == "fp32" else DTYPES[precision]
    t_local = T // p.tp if p.sp else T

    def hidden() -> torch.Tensor:  # requires_grad: a gradient flows back through it
        return torch.empty(mb, t_local, mcfg.n_embd, dtype=compute, device=DEVICE, requires_grad=True)

    inputs = [torch.zeros(mb, T, dtype=torch.long, device=DEVICE) if s == 0 else hidden() for s in ids]
    outputs = [
        torch.empty(mb, T, mcfg.padded_vocab, dtype=logits, device=DEVICE, requires_grad=True)
        if s == n_stages - 1
        else hidden()
        for s in ids
    ]
    return inputs, outputs
