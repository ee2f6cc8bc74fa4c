"""Tensor, sequence and pipeline parallelism composed with data parallelism on one DeviceMesh (dp, pp, tp).

Everything is applied from outside to the single-device GPT (model/gpt.py), in torchtitan's order:

1. **Tensor parallel** (Megatron-LM's split, Shoeybi et al. 2019) with DTensor's `parallelize_module` on the
   "tp" mesh dimension: q/k/v and the MLP up-projection column-wise (each rank holds whole heads), the
   attention output and MLP down-projection row-wise (one all-reduce per sub-layer), the token embedding
   vocabulary-parallel (row-wise) and the tied LM head column-wise over the vocabulary, so the cross-entropy
   runs under `loss_parallel()` without gathering the full logits. **Sequence parallel** (Korthikanti et
   al. 2022) keeps the LayerNorms and dropouts on sequence shards: the all-reduces become all-gather +
   reduce-scatter pairs.
2. **Pipeline parallel** with `torch.distributed.pipelining`: the layers are cut into balanced stages (the
   embeddings on the first, the final norm and head on the last), one per rank (GPipe, 1F1B) or two per rank
   in a loop (interleaved 1F1B, interleaved zero-bubble). The head is tied to the embedding as in GPT-2; with
   pp > 1 the two copies live on the first and last stage and their gradients are summed across the
   pipeline group after backward (Megatron's embedding group), so they stay equal.
3. **Data parallel** over the "dp" dimension: FSDP2 (`dp_impl=fsdp|zero2`) on every block and stage root,
   or replicated parameters whose gradients are averaged in one coalesced all-reduce (`dp_impl=ddp`).

The trainer sees a `DataParallel` whose rank/size are the data-parallel coordinates (which batch shard this
rank reads). Checkpoints stay loom's ordinary full, unsharded state: every stage's tensors are gathered to
global rank 0 (DTensor.full_tensor), merged under the single-device GPT's names, and loaded back by slicing,
so a run saved with one layout resumes under any other and `loom generate` reads it.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from loom import log
from loom.distributed.topology import Topology
from loom.errors import LoomError
from loom.model.gpt import GPT
from loom.optim.build import build_optimizer, param_groups
from loom.parallel.base import DataParallel

TIED = ("wte.weight", "lm_head.weight")  # one tensor in the single-device model


def _is_dtensor(t) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if _is_dtensor(t) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (a collective over the DTensor's mesh)."""
    return (t.full_tensor() if _is_dtensor(t) else t).detach().cpu()


def _like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `ref`: sliced into ref's shard when ref is a DTensor (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=_local(ref).device, dtype=ref.dtype)
    if _is_dtensor(ref):
        return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)
    return full


# ---------------------------------------------------------------------------------------------- tensor parallel
def apply_tp(model: GPT, tp_mesh, sp: bool, loss_parallel: bool) -> None:
    """Megatron split of every block, vocabulary-parallel embedding and head; sequence parallel if sp."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    if model.cfg.padded_vocab % tp:
        raise LoomError(
            f"the padded vocabulary {model.cfg.padded_vocab} is not divisible by parallel.tp={tp}"
        )
    seq = Shard(1) if sp else Replicate()
    # Embedding rows (the vocabulary) are split; ids outside a rank's range give zeros and the all-reduce of
    # the partial sums restores the lookup. Its output stays replicated so the position embedding can be added.
    parallelize_module(
        model.wte, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    )
    for i, block in enumerate(model.blocks):
        plan = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=seq),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        }
        if sp:  # LayerNorm on sequence shards; attention and MLP gather the sequence first
            plan.update({
                "ln_1": SequenceParallel(),
                "ln_2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                           desired_input_layouts=(Replicate(), None, None), use_local_output=True),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
            })  # fmt: skip
            if i == 0:  # the first block keeps only its own slice of the replicated embedding output
                plan[""] = PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                              desired_input_layouts=(Shard(1), None, None), use_local_output=True)  # fmt: skip
        for name, style in plan.items():
            parallelize_module(block.get_submodule(name) if name else block, tp_mesh, style)
    if sp:
        parallelize_module(model.ln_f, tp_mesh, SequenceParallel())
    head = ColwiseParallel(
        input_layouts=seq,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    parallelize_module(model.lm_head, tp_mesh, head)
    model.lm_head.weight = model.wte.weight  # re-tie: both are Shard(0) over the vocabulary


class LocalLoss(nn.Module):
    """The model with its (replicated DTensor) loss returned as a plain tensor, for the trainer's sums."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, idx, targets=None):
        out = self.model(idx, targets)
        return out.to_local() if targets is not None and _is_dtensor(out) else out


# -------------------------------------------------------------------------------------------- pipeline parallel
def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """Balanced contiguous layer ranges, the extra layers going to the middle stages (the first stage also
    runs the embeddings and the last the head, so they get the smaller share)."""
    base, extra = divmod(n_layer, n_stages)
    sizes = [base] * n_stages
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), abs(s - (n_stages - 1) / 2)))
    for s in order[:extra]:
        sizes[s] += 1
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(starts[s], starts[s] + sizes[s]) for s in range(n_stages)]


class Stage(nn.Module):
    """A contiguous slice of the GPT. Submodule names equal the single-device model's (blocks keep their
    index), so a stage's parameter names are the full model's."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for name, block in self.blocks.items():
            x = block(x, None, int(name))
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1), ignore_index=-1)


SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}


# ------------------------------------------------------------------------------------------------ the composition
class MeshParallel(DataParallel):
    """dp x pp x tp on one DeviceMesh; rank/size are the data-parallel coordinates."""

    def __init__(self, topo: Topology, device: torch.device, pcfg, dp_impl: str, n_microbatches: int = 1):
        self.topo, self.device, self.pcfg = topo, device, pcfg
        self.rank, self.size = topo.dp_rank, topo.dp
        self.fsdp = dp_impl in ("fsdp", "zero2")
        self.reshard = dp_impl == "fsdp"
        self.n_microbatches = n_microbatches
        self.pipelined = topo.pp > 1
        self.mesh = None
        self.stages: list[Stage] = []
        self.schedule = None

    @property
    def world_size(self) -> int:
        return self.topo.world_size

    @property
    def is_main(self) -> bool:
        return self.topo.rank == 0

    def describe(self) -> str:
        t = self.topo
        dp = f"dp {t.dp} ({'fsdp' if self.fsdp and self.reshard else 'zero2' if self.fsdp else 'replicated'})"
        pp = (
            f" | pp {t.pp} ({self.pcfg.pp_schedule}, {self.n_microbatches} micro-batches)" if t.pp > 1 else ""
        )
        return f"{dp} | tp {t.tp}{' + sp' if self.pcfg.sp else ''}{pp}"

    # ----------------------------------------------------------------------------- building
    def wrap(self, model: GPT) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        t = self.topo
        self.mesh = init_device_mesh(self.device.type, (t.dp, t.pp, t.tp), mesh_dim_names=("dp", "pp", "tp"))
        self._remember_full_layout(model)
        if t.tp > 1:
            apply_tp(model, self.mesh["tp"], self.pcfg.sp, loss_parallel=not self.pipelined)
        if self.pipelined:
            self._split(model)
        if self.fsdp and t.dp > 1:
            self._shard(model)
        if self.pipelined:
            self._tied_group = self._first_last_group()
            return self._build_schedule()
        return LocalLoss(model)

    def eval_model(self, raw: nn.Module, wrapped: nn.Module) -> nn.Module:
        return wrapped

    def _first_last_group(self):
        """The group of the first and last pipeline stage with this rank's dp and tp coordinates (every rank
        creates every group, in the same order, as torch.distributed requires)."""
        t, mine = self.topo, None
        for d in range(t.dp):
            for k in range(t.tp):
                ranks = [d * t.pp * t.tp + s * t.tp + k for s in (0, t.pp - 1)]
                group = dist.new_group(ranks)
                if t.rank in ranks:
                    mine = group
        return mine

    def _split(self, model: GPT) -> None:
        """Keep this rank's stages; the rest of the model is dropped (its names disappear from the module)."""
        t = self.topo
        per_rank = 2 if self.pcfg.pp_schedule in ("interleaved-1f1b", "zero-bubble") else 1
        n_stages = t.pp * per_rank
        ranges = stage_layers(model.cfg.n_layer, n_stages)
        self.stage_ids = [t.pp_rank + k * t.pp for k in range(per_rank)]  # looped placement
        self.n_stages = n_stages
        self.stages = [Stage(model, ranges[s], s == 0, s == n_stages - 1) for s in self.stage_ids]
        keep = {i for s in self.stage_ids for i in ranges[s]}
        for i in range(model.cfg.n_layer):
            if i not in keep:
                model.blocks._modules[str(i)] = None
        self.holds_first = 0 in self.stage_ids
        self.holds_last = n_stages - 1 in self.stage_ids
        if not self.holds_first:
            model.wte = model.wpe = model.drop = None  # the tied tensor stays reachable as lm_head.weight
        if not self.holds_last:
            model.ln_f = model.lm_head = None
        log.info(f"pipeline rank {t.pp_rank}: stages {self.stage_ids} of {n_stages}, layers "
                 f"{[list(ranges[s]) for s in self.stage_ids]}")  # fmt: skip

    def _shard(self, model: GPT) -> None:
        from torch.distributed.fsdp import fully_shard

        kw = {"mesh": self.mesh["dp"], "reshard_after_forward": self.reshard}
        roots = self.stages or [model]
        for root in roots:
            for block in root.blocks.values() if isinstance(root, Stage) else root.blocks:
                fully_shard(block, **kw)
            fully_shard(root, **kw)

    def _build_schedule(self):
        from torch.distributed import pipelining

        group = self.mesh["pp"].get_group()
        pstages = [
            pipelining.PipelineStage(st, sid, self.n_stages, self.device, group=group)
            for st, sid in zip(self.stages, self.stage_ids, strict=True)
        ]
        cls = getattr(pipelining, SCHEDULES[self.pcfg.pp_schedule])
        if len(pstages) == 1:
            self.schedule = cls(pstages[0], n_microbatches=self.n_microbatches, loss_fn=lm_loss)
        else:
            self.schedule = cls(pstages, n_microbatches=self.n_microbatches, loss_fn=lm_loss)
        return self.stages[0]

    def build_optimizer(self, model, ocfg, device):
        # torch's fused and foreach AdamW want one kind of tensor per list; with tensor parallel the model mixes
        # DTensor matrices with plain LayerNorm gains, so the per-parameter loop is used there.
        from dataclasses import replace

        if self.topo.tp > 1 and not (self.fsdp and self.topo.dp > 1):
            impl = "torch-loop"
        else:
            impl = "torch-foreach" if ocfg.impl in ("auto", "torch-fused") else ocfg.impl
        if impl != ocfg.impl and ocfg.impl not in ("auto",):
            log.warn(f"optim.impl={ocfg.impl} does not take this layout's parameters; using {impl}")
        return build_optimizer(model, replace(ocfg, impl=impl), device)

    # ----------------------------------------------------------------------------- steps
    def loss_context(self):
        if self.topo.tp > 1 and not self.pipelined:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def pipeline_step(self, x: torch.Tensor, y: torch.Tensor, autocast) -> torch.Tensor:
        """One forward/backward of the local batch through the schedule; the mean loss on the last stage."""
        losses: list[torch.Tensor] = []
        with autocast():
            self._run_schedule(self.schedule.step, x, y, losses)
        if self.holds_last:
            return torch.stack([loss.detach() for loss in losses]).mean()
        return torch.zeros((), device=self.device)

    def _run_schedule(self, fn, x, y, losses):
        args = (x,) if self.holds_first else ()
        kwargs = {"target": y, "losses": losses} if self.holds_last else {}
        fn(*args, **kwargs)

    def after_backward(self) -> None:
        for p in self._model.parameters():
            # A vocabulary-parallel embedding's gradient comes back Partial (each rank a full-size partial sum);
            # lay every gradient out like its parameter before anything reads the local shards.
            if p.grad is not None and _is_dtensor(p.grad) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if self.pipelined and (self.holds_first or self.holds_last):
            # The tied embedding/head: the first stage's and the last stage's gradients are two halves of one.
            m = self._model
            w = m.lm_head.weight if self.holds_last else m.wte.weight
            if w.grad is not None:
                dist.all_reduce(_local(w.grad), group=self._tied_group)
        if not self.fsdp and self.topo.dp > 1:
            # Replicated data parallel: one coalesced all-reduce of the local gradients, averaged.
            grads = [_local(p.grad) for p in self._model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.mesh["dp"].get_group())
            flat /= self.topo.dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global gradient norm over all ranks, each distinct value counted once, then clip by it."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            copies = self._replicas(p.grad)
            if self.pipelined and name in TIED and not (self.holds_first and self.holds_last):
                copies *= 2  # the first and the last stage hold the same summed gradient
            g = _local(p.grad)
            grads.append(g)
            sq += g.double().pow(2).sum() / copies
        dist.all_reduce(sq)
        norm = sq.sqrt().float()
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return norm

    def _replicas(self, g: torch.Tensor) -> int:
        """How many ranks of this pipeline stage hold exactly this (local) gradient."""
        sizes = {"dp": self.topo.dp, "tp": self.topo.tp}
        if not _is_dtensor(g):
            return sizes["dp"] * sizes["tp"]
        from torch.distributed.tensor import Replicate

        names = g.device_mesh.mesh_dim_names or ()
        n = 1
        for dim, pl in zip(names, g.placements, strict=True):
            if isinstance(pl, Replicate):
                n *= sizes.get(dim, 1)
        for dim, size in sizes.items():
            if dim not in names:
                n *= size
        return n

    def mean_loss(self, t: torch.Tensor) -> torch.Tensor:
        """The mean over data-parallel replicas of the last stage's loss (zeros elsewhere)."""
        holds = not self.pipelined or self.holds_last
        t = t.detach().clone() if holds else torch.zeros_like(t)
        dist.all_reduce(t)
        return t / (self.topo.dp * self.topo.tp)

    @torch.no_grad()
    def pipeline_val_loss(self, valset, micro_batch_size: int, device, autocast) -> float:
        """Mean token loss over the validation set, forward-only through the schedule."""
        for st in self.stages:
            st.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)
        full = micro_batch_size * self.n_microbatches
        for x, y in valset.batches(full):
            # The stages exchange fixed shapes: a short last batch is padded with ignored targets (-1).
            if len(x) < full:
                pad = full - len(x)
                x = torch.cat([x, x[:1].expand(pad, -1)])
                y = torch.cat([y, torch.full((pad, y.size(1)), -1, dtype=y.dtype)])
            losses: list[torch.Tensor] = []
            with autocast():
                self._run_schedule(self.schedule.eval, x.to(device), y.to(device), losses)
            if self.holds_last:
                for loss, yc in zip(losses, y.chunk(self.n_microbatches), strict=True):
                    n = int((yc != -1).sum())
                    if n:
                        total[0] += loss.double() * n
                        total[1] += n
        for st in self.stages:
            st.train()
        total = self.all_reduce_sum(total)
        return (total[0] / total[1]).item()

    # ----------------------------------------------------------------------------- collectives
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t)
        return t

    def broadcast_object(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_model(self, model) -> None:
        """Every rank built the same model from run.seed, and loads the same full checkpoint: nothing to send."""

    # ----------------------------------------------------------------------------- checkpoints (full state)
    def _gather(self, local: dict) -> dict:
        """Merge every pipeline stage's dict on global rank 0 (one sender per stage: dp 0, tp 0)."""
        sender = self.topo.dp_rank == 0 and self.topo.tp_rank == 0
        parts = [None] * self.topo.world_size if self.is_main else None
        dist.gather_object(local if sender else None, parts, dst=0)
        merged: dict = {}
        for part in parts or []:
            if part:
                merged.update(part)
        return merged

    def model_state(self, model) -> dict:
        local = {k: _full(v) for k, v in model.state_dict().items()}
        merged = self._gather(local)
        if not self.is_main:
            return {}
        w = merged.get("wte.weight", merged.get("lm_head.weight"))
        merged["wte.weight"] = merged["lm_head.weight"] = w
        return {k: merged[k] for k in self._full_names_sd}

    def load_model_state(self, model, sd: dict) -> None:
        with torch.no_grad():
            for name, p in model.state_dict(keep_vars=True).items():
                src = sd["wte.weight"] if name in TIED else sd[name]
                _local(p).copy_(_local(_like(src, p)))

    def optim_state(self, model, opt) -> dict:
        sd = opt.state_dict()
        names = _optimizer_names(model, opt)
        local = {
            "state": {names[i]: {k: _full(v) if v.dim() else v for k, v in s.items()} for i, s in sd["state"].items()},
            "groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
        }  # fmt: skip
        sender = self.topo.dp_rank == 0 and self.topo.tp_rank == 0
        parts = [None] * self.topo.world_size if self.is_main else None
        dist.gather_object(local if sender else None, parts, dst=0)
        if not self.is_main:
            return {}
        state, groups = {}, None
        for part in parts:
            if not part:
                continue
            for n, s in part["state"].items():
                state[_canonical(n)] = s
            if groups is None:
                groups = [{**g, "params": []} for g in part["groups"]]
        order = self._full_optim_order
        index = {n: i for i, n in enumerate(n for g in order for n in g)}
        for gi, names_in_group in enumerate(order):
            groups[gi]["params"] = [index[n] for n in names_in_group]
        return {"state": {index[n]: s for n, s in state.items()}, "param_groups": groups}

    def load_optim_state(self, model, opt, sd: dict) -> None:
        order = [n for g in self._full_optim_order for n in g]
        names = _optimizer_names(model, opt)
        params = [p for g in opt.param_groups for p in g["params"]]
        local_state = {}
        for i, (name, p) in enumerate(zip(names, params, strict=True)):
            s = sd["state"].get(order.index(_canonical(name)))
            if s is not None:
                local_state[i] = {k: _like(v, p) if v.dim() else v for k, v in s.items()}
        groups = [{**g, "params": [names.index(_n) for _n in gn]} for g, gn in zip(
            sd["param_groups"], self._local_group_names(model, opt), strict=True)]  # fmt: skip
        opt.load_state_dict({"state": local_state, "param_groups": groups})

    def _local_group_names(self, model, opt) -> list[list[str]]:
        ids = {id(p): n for n, p in model.named_parameters()}
        return [[ids[id(p)] for p in g["params"]] for g in opt.param_groups]

    def _remember_full_layout(self, model: GPT) -> None:
        """Names of the single-device model (state-dict keys and optimizer order), taken before any split."""
        self._full_names_sd = list(model.state_dict().keys())
        ids = {id(p): n for n, p in model.named_parameters()}
        self._full_optim_order = [[ids[id(p)] for p in g["params"]] for g in param_groups(model, 0.0)]
        self._model = model

    def sampling_model(self, model) -> nn.Module | None:
        """A whole single-device copy on global rank 0 (a collective: every rank sends its part)."""
        sd = self.model_state(model)
        if not self.is_main:
            return None
        full = GPT(model.cfg).to(self.device)
        full.load_state_dict(sd)
        return full


def _canonical(name: str) -> str:
    return "wte.weight" if name in TIED else name


def _optimizer_names(model: nn.Module, opt) -> list[str]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for g in opt.param_groups for p in g["params"]]
