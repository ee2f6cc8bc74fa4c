"""Checking a config (layer 0). `validate(cfg, world)` is the one check of a config against a world size: each
field's bounds (declared on the field), the model's shape, the parallel layout and the batch, each rule in one
place; it returns the values printed at start (gradient accumulation, tokens per step) and the layout
(ParallelDims). `check_model_config` / `check_saved_config` compare the model a checkpoint recorded with a
run's config.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import fields
from typing import Any

from loom.config.layout import SHARDED, Derived, ParallelDims
from loom.config.schedules import check_schedules, micro_windows
from loom.config.schema import (
    _LR,
    _LR_HINT,
    FAMILY_SECTIONS,
    SCHEDULE_STAGES_PER_RANK,
    Config,
    ModelConfig,
    ParallelConfig,
    section_types,
)
from loom.errors import LoomError


def validate(
    cfg: Config, world: int = 1, rank: int = 0, dp_impl: str | None = None
) -> tuple[Derived, ParallelDims]:
    """Every rule that can be checked before data or devices are touched, each in one place, in this order:
    each field's bounds (its metadata), the model's shape, the mesh of `world` processes (world = dp x cp x tp x pp),
    the data-parallel implementation (`dp_impl`, default parallel.dp_impl; auto resolved here), the batch.
    Returns the derived values printed at start and the layout of `rank`."""
    _check_fields(cfg)
    _check_model_shape(cfg.model)
    _check_doc_mask(cfg)
    _check_cp(cfg, dp_impl or cfg.parallel.dp_impl)
    dp = _check_mesh(cfg, world)
    impl = _resolve_dp_impl(cfg, world, dp, dp_impl)
    _check_family(cfg, dp, impl)
    _check_fp8(cfg)
    _check_eval(cfg)
    _check_lora(cfg)
    _check_qlora(cfg, world, impl)
    _check_diagnostics(cfg, world)
    _check_rl(cfg, dp, impl)
    _check_compression(cfg, impl)
    _check_diloco(cfg, world, impl)
    replicate, shard = _dp_degrees(cfg.parallel, dp, impl)
    derived = derive_batch(cfg, dp)
    p = cfg.parallel
    degree1 = p.degree1_meshes and world == 1
    diloco = p.diloco_inner_steps > 0
    return derived, ParallelDims(
        replicate, shard, p.tp, p.pp, world, rank, impl, degree1, p.cp, p.ep, diloco=diloco
    )


def _check_rl(cfg: Config, dp: int, dp_impl: str) -> None:
    """rl.*: groups of at least two answers, whole groups per data-parallel rank, and the layouts whose every
    rank samples whole answers (loom.rl samples with the model as it trains: whole, sharded or tp-split)."""
    r, t, p = cfg.rl, cfg.train, cfg.parallel
    if not r.prompts:
        return
    if r.group_size < 2:
        raise LoomError(
            f"rl.group_size={r.group_size}: an advantage is a reward against its group's, and a group of one has "
            "nothing to compare with (its advantage is always 0)",
            hint="set rl.group_size >= 2 (8 or 16 are usual)",
        )
    if t.batch_size % (r.group_size * dp):
        raise LoomError(
            f"train.batch_size={t.batch_size} answers must be whole groups of rl.group_size={r.group_size} on "
            f"each of the {dp} data-parallel ranks",
            hint=f"make train.batch_size a multiple of {r.group_size * dp}",
        )
    if p.pp > 1 or p.cp > 1 or dp_impl == "mpi":
        raise LoomError(
            "loom rl samples with the model as it trains, a whole answer per rank: it runs on data parallel "
            f"(ddp, zero1, fsdp, zero2) and tensor parallel (here pp={p.pp}, cp={p.cp}, dp_impl={dp_impl})",
            hint="use pp = cp = 1 and a torch dp_impl (ddp, zero1, fsdp, zero2), with or without parallel.tp",
        )
    if p.tp > 1 and p.sp:
        raise LoomError(
            "loom rl with parallel.sp: the sampler decodes one token per row, which sequence parallel cannot split "
            "over the tensor-parallel ranks",
            hint="set parallel.sp=false (tensor parallel samples and trains without it)",
        )
    if r.max_new_tokens >= cfg.model.block_size:
        raise LoomError(
            f"rl.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in model.block_size="
            f"{cfg.model.block_size}: a prompt and its answer share one block",
            hint=f"set rl.max_new_tokens below {cfg.model.block_size} (the longest prompt plus it must fit)",
        )
    _check_rl_async(cfg, dp, dp_impl)
    _check_rl_env(cfg)


def _check_rl_env(cfg: Config) -> None:
    """rl.env's keys (loom.rl.env checks the name and imports the class itself, before any work): at least one
    turn, a token budget with room for a turn."""
    r = cfg.rl
    if not r.env:
        return
    if r.max_turns < 1:
        raise LoomError(
            f"rl.max_turns={r.max_turns}: an episode needs at least one model turn",
            hint="set rl.max_turns >= 1 (a tool call and an answer: 2)",
        )
    if r.max_episode_tokens and r.max_episode_tokens < r.max_new_tokens:
        raise LoomError(
            f"rl.max_episode_tokens={r.max_episode_tokens} is less than one turn's rl.max_new_tokens="
            f"{r.max_new_tokens}",
            hint="raise rl.max_episode_tokens (or 0: what model.block_size leaves after the prompt)",
        )


def _check_rl_async(cfg: Config, dp: int, dp_impl: str) -> None:
    """rl.max_staleness > 0 (loom.rl.async_rollout): the rollout worker holds a whole copy of the model and gets
    the trainer's whole weights pushed to it, and rl.is_cap's weights correct the samples' lag."""
    r, p = cfg.rl, cfg.parallel
    if not r.max_staleness:
        return
    what = f"rl.max_staleness={r.max_staleness}"
    if r.is_cap <= 0:
        raise LoomError(
            f"{what} trains on answers sampled by weights up to {r.max_staleness} steps old, and rl.is_cap=0 "
            "turns off the truncated importance weights that correct for that",
            hint="set rl.is_cap > 0 (2 is the default), or rl.max_staleness=0 (synchronous rollouts)",
        )
    if dp > 1:
        raise LoomError(
            f"{what} with {dp} data-parallel ranks: the rollout worker is built and tested for one trainer "
            "process here (a worker and a weight group per rank is not)",
            hint="run loom rl with one process for asynchronous rollouts, or rl.max_staleness=0 under --nproc",
        )
    sharded = p.tp > 1 or cfg.finetune.quantize_base == "nf4"
    if sharded:
        raise LoomError(
            f"{what}: the rollout worker is sent whole weights, and this layout holds pieces of them "
            f"(parallel.tp={p.tp}, finetune.quantize_base={cfg.finetune.quantize_base})",
            hint="asynchronous rollouts run on one process without NF4; or set rl.max_staleness=0",
        )
    if getattr(r, "env", ""):
        raise LoomError(
            f"{what} with rl.env: the rollout worker samples single answers; multi-turn episodes run in the "
            "trainer's process",
            hint="set rl.max_staleness=0 with rl.env",
        )


def _check_compression(cfg: Config, impl: str) -> None:
    """parallel.grad_compression is a DDP communication hook: only where DDP's wrapper all-reduces gradients."""
    p = cfg.parallel
    kind = p.grad_compression
    if kind == "none":
        return
    if impl in SHARDED:
        hint = (
            "FSDP reduce-scatters in parallel.reduce_dtype: set parallel.reduce_dtype=" + kind
            if kind in ("bf16", "fp16")
            else "PowerSGD needs whole gradient matrices: use parallel.dp_impl=ddp (or parallel.diloco_inner_steps "
            "for slow links with FSDP inside a node)"
        )
        raise LoomError(f"parallel.grad_compression={kind} does not apply to dp_impl={impl}", hint=hint)
    if impl not in ("ddp", "zero1") or p.tp * p.pp * p.cp > 1 or p.ep > 1:
        raise LoomError(
            f"parallel.grad_compression={kind} compresses DDP's gradient all-reduce; this layout (dp_impl={impl}, "
            f"tp={p.tp}, pp={p.pp}, cp={p.cp}, ep={p.ep}) has none",
            hint="use parallel.dp_impl=ddp with data parallel only, or grad_compression=none",
        )


def _check_diloco(cfg: Config, world: int, impl: str) -> None:
    """DiLoCo runs across the replicate dimension (parallel.dp_replicate), with ddp or fsdp inside a replica;
    checkpoints are written between outer steps only, where every replica holds the same parameters."""
    p, t = cfg.parallel, cfg.train
    h = p.diloco_inner_steps
    if not h:
        return
    # one torchft replica group (loom.distributed.ft): the ft replica groups are DiLoCo's replicas
    ft_group = cfg.ft.enabled and p.dp_replicate == 1
    if world == 1 and not ft_group:  # a lone replica: its outer step averages nothing (resumed alone too)
        r = p.dp_replicate
        raise LoomError(
            f"parallel.diloco_inner_steps={h} on one process: DiLoCo averages what its replicas learned, and one "
            "process is a single replica with nothing to average"
            + (f" (this run's parallel.dp_replicate={r} needs at least {r} processes)" if r > 1 else ""),
            hint=(
                f"run it with --nproc {r} (or a multiple: ddp or fsdp inside each replica), or "
                if r > 1
                else "start it with --nproc N --parallel.dp_replicate=R (R replicas of N/R processes), or "
            )
            + "continue as plain training on one process with --parallel.diloco_inner_steps=0 "
            "--parallel.dp_replicate=1",
        )
    if world > 1 and p.dp_replicate == 1 and not ft_group:
        raise LoomError(
            f"parallel.diloco_inner_steps={h} needs a replicate dimension: parallel.dp_replicate is 1 on "
            f"{world} processes",
            hint="set parallel.dp_replicate to the number of nodes (DiLoCo across them, ddp/fsdp inside)",
        )
    if p.tp * p.pp * p.cp > 1 or p.ep > 1:
        raise LoomError(
            f"parallel.diloco_inner_steps does not compose with tp/pp/cp/ep (tp={p.tp}, pp={p.pp}, cp={p.cp}, "
            f"ep={p.ep}) here",
            hint="use data parallel inside a replica: parallel.dp_impl=ddp or fsdp",
        )
    if impl not in ("ddp", "fsdp", "none"):
        raise LoomError(
            f"parallel.diloco_inner_steps does not compose with parallel.dp_impl={impl}",
            hint="use parallel.dp_impl=ddp or fsdp inside a replica",
        )
    if t.time_budget_s:
        raise LoomError(
            "train.time_budget_s chooses train.steps while training; DiLoCo needs it a multiple of "
            "parallel.diloco_inner_steps from the start",
            hint="give train.steps instead",
        )
    for key, n in (("train.steps", t.steps), ("train.ckpt_every", t.ckpt_every)):
        if n % h:
            raise LoomError(
                f"{key}={n} is not a multiple of parallel.diloco_inner_steps={h}: DiLoCo's replicas hold the same "
                "parameters only after an outer step, where a run ends and saves",
                hint=f"make {key} a multiple of {h}",
            )


def _check_mtp(cfg: Config, section) -> None:
    """model.mtp_depth: a family with MTP modules, on the data-parallel layouts (its modules are neither split
    by tensor/context parallel's plans nor placed on a pipeline stage)."""
    m, p = cfg.model, cfg.parallel
    if section is None or not section.mtp:
        mtp = ", ".join(f for f, s in FAMILY_SECTIONS.items() if s.mtp) or "none registered"
        raise LoomError(
            f"model.mtp_depth: the family '{m.family}' has no multi-token prediction modules (families that do: "
            f"{mtp})",
            hint="drop model.mtp_depth, or use one of those families",
        )
    split = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp") if getattr(p, k) > 1]
    if split:
        raise LoomError(
            f"model.mtp_depth={m.mtp_depth} runs on the data-parallel layouts (ddp, fsdp, zero1/2, HSDP) only; "
            f"this run sets {', '.join(split)}: the MTP modules are in no tensor, context or pipeline plan",
            hint="leave parallel.tp, parallel.pp and parallel.cp at 1 with model.mtp_depth, or drop it",
        )


def _check_family(cfg: Config, dp: int, dp_impl: str) -> None:
    """The family's own rules (its registration's check: a MoE's k of E, ...), then expert parallelism: only a
    family with expert layers takes parallel.ep, over the data-parallel x cp ranks, with ddp, fsdp or zero2."""
    m, p = cfg.model, cfg.parallel
    section = FAMILY_SECTIONS.get(m.family)
    if m.mup and (section is None or not section.mup):
        mup = ", ".join(f for f, s in FAMILY_SECTIONS.items() if s.mup) or "none registered"
        raise LoomError(
            f"model.mup: the family '{m.family}' does not declare its parameters' widths (which weights are "
            f"embeddings, hidden matrices, the output head), so muP cannot scale them; families that do: {mup}",
            hint="drop model.mup, or use one of those families",
        )
    if m.mtp_depth:
        _check_mtp(cfg, section)
    if m.mup and not m.mup_base_width:
        raise LoomError(
            "model.mup needs model.mup_base_width, the n_embd the hyperparameters were tuned at",
            hint=f"e.g. --model.mup_base_width=64 (this model's n_embd is {m.n_embd})",
        )
    if section is not None and section.check is not None:
        section.check(cfg)
    if p.ep == 1:
        return
    if section is None or not section.experts:
        experts = ", ".join(f for f, s in FAMILY_SECTIONS.items() if s.experts) or "none registered"
        raise LoomError(
            f"parallel.ep={p.ep} is for a family with expert layers ({experts}); the family is '{m.family}'",
            hint="set model.family=moe (a Llama-shaped model with routed experts), or leave parallel.ep=1",
        )
    if (dp * p.cp) % p.ep:
        raise LoomError(
            f"parallel.ep={p.ep} does not divide the data-parallel x cp ranks, {dp} x {p.cp} (expert parallelism "
            "splits the experts over those ranks)",
            hint="pick ep among the divisors of " + f"{dp * p.cp}: " + _divisors(dp * p.cp),
        )
    if dp_impl not in ("ddp", "fsdp", "zero2"):
        raise LoomError(
            f"parallel.ep > 1 does not compose with parallel.dp_impl={dp_impl}",
            hint="use parallel.dp_impl=ddp or fsdp (or zero2) with expert parallelism",
        )


def _check_eval(cfg: Config) -> None:
    """eval.*: lm-evaluation-harness found (not imported: loom.eval.capability imports it when the trainer
    starts, and checks the task names and data there, before the model is built)."""
    e = cfg.eval
    if not (e.tasks.strip(" ,") or e.core_bundle):
        if e.every:
            raise LoomError(
                f"eval.every={e.every} has nothing to score: eval.tasks and eval.core_bundle are empty",
                hint="name tasks (--eval.tasks=hellaswag,arc_easy) or a CORE bundle, or set eval.every=0",
            )
        return
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise LoomError(
            "eval.tasks / eval.core_bundle need lm-evaluation-harness, which is not installed",
            hint="install the eval extra: pip install 'loom[eval]'",
        )


def _check_lora(cfg: Config) -> None:
    """finetune.lora_*: what adapters compose with (their targets are checked against the model when it is
    built: loom.model.lora.apply_lora)."""
    f = cfg.finetune
    if f.lora_embeddings not in ("auto", "true", "false"):
        raise LoomError(f"finetune.lora_embeddings must be auto, true or false; got '{f.lora_embeddings}'")
    if f.init_optimizer and (not cfg.model.init_from.startswith("run:") or f.lora_rank):
        raise LoomError(
            "finetune.init_optimizer=true takes the optimizer state of the run model.init_from=run:DIR names, "
            f"for the same parameters; here model.init_from='{cfg.model.init_from}', finetune.lora_rank="
            f"{f.lora_rank}",
            hint="use it with model.init_from=run:DIR and full fine-tuning (finetune.lora_rank=0)",
        )
    if not f.lora_rank:
        return
    if cfg.precision.fp8 != "off":
        raise LoomError(
            "finetune.lora_rank > 0 with precision.fp8: torchao's Float8Linear replaces the adapted linears "
            "and would drop their adapters",
            hint="fine-tune LoRA in bf16 (precision.fp8=off)",
        )


def _check_qlora(cfg: Config, world: int, impl: str = "none") -> None:
    """finetune.quantize_base=nf4 (QLoRA) and optim.state_dtype / optim.offload (torchao's low-bit and offload
    optimizers): what they compose with, from the config alone. A weight NF4 cannot hold is refused when the
    model's shapes are known (loom.model.nf4.check_nf4, from loom.train.finetune.check_lora_targets); offload
    on a CPU device when the device is known (loom.optim.build)."""
    f, o = cfg.finetune, cfg.optim
    torchao = importlib.util.find_spec("torchao") is not None
    hint = "install torchao: pip install -e '.[fp8]' (the fp8 extra carries it)"
    if f.quantize_base == "nf4":
        if not f.lora_rank:
            raise LoomError(
                "finetune.quantize_base=nf4 quantizes a frozen base, and without LoRA every weight trains",
                hint="set finetune.lora_rank=16, say (QLoRA), or finetune.quantize_base=none",
            )
        if world > 1:
            _check_qlora_layout(cfg, world, impl)
        if not torchao:
            raise LoomError("finetune.quantize_base=nf4 needs torchao, which is not installed", hint=hint)
    if o.state_dtype or o.offload != "none":
        what = f"optim.state_dtype={o.state_dtype}" if o.state_dtype else f"optim.offload={o.offload}"
        if o.name != "adamw":
            raise LoomError(
                f"{what} is torchao's AdamW; optim.name={o.name} has its own optimizer",
                hint="use optim.name=adamw with it, or leave it unset",
            )
        if o.state_dtype and o.offload != "none":
            raise LoomError(
                f"optim.state_dtype={o.state_dtype} with optim.offload={o.offload}: torchao's offload wraps a "
                "full-precision AdamW on the host, where low-bit states save no device memory",
                hint="choose one",
            )
        if o.offload != "none" and cfg.train.device == "cpu":
            raise LoomError(
                f"optim.offload={o.offload} moves the optimizer state from a GPU to the host; train.device=cpu "
                "keeps it there already (torchao's CPUOffloadOptimizer serves CUDA and XPU parameters only)",
                hint="leave optim.offload=none on a CPU (optim.state_dtype=int8 shrinks the state there)",
            )
        if o.offload != "none" and world > 1:
            raise LoomError(
                f"optim.offload={o.offload} runs in one process in loom; this job has {world}",
                hint="use parallel.dp_impl=fsdp to shard the optimizer state over several processes instead",
            )
        if not torchao:
            raise LoomError(f"{what} needs torchao, which is not installed", hint=hint)


def _check_qlora_layout(cfg: Config, world: int, impl: str) -> None:
    """QLoRA over several processes: FSDP2's data-parallel sharding only (fsdp or zero2 on one mesh dimension),
    which torchao's NF4Tensor serves through FSDP2's all-gather hooks (fsdp_pre/post_all_gather: each rank
    holds whole rows of 4-bit codes and scales, gathered as they are). Refused: tensor parallel (its row-wise
    split cuts the input features, across NF4's blocks of 64, and NF4 implements no DTensor sharding but FSDP's
    dim-0 split), pipeline, context and expert parallel, HSDP's second mesh dimension (NF4's hook asks the
    mesh for one group), DDP, ZeRO-1, MPI and DiLoCo (they broadcast or average the frozen weights, and NF4
    implements no broadcast or all-reduce). A weight whose rows or NF4 blocks the ranks cannot split evenly is
    refused with the model's shapes (loom.model.nf4.check_nf4)."""
    p = cfg.parallel
    others = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(p, k) > 1]
    if p.dp_replicate > 1:
        others.append(f"parallel.dp_replicate={p.dp_replicate} (HSDP)")
    if p.diloco_inner_steps:
        others.append("DiLoCo")
    if impl not in ("fsdp", "zero2") and world // (p.tp * p.pp * p.cp) > 1:  # data-parallel ranks: FSDP's
        others.insert(0, f"parallel.dp_impl={impl}")
    if others:
        raise LoomError(
            f"finetune.quantize_base=nf4 over {world} processes is served by FSDP's data-parallel sharding "
            f"only, not by {', '.join(others)}: torchao's NF4Tensor implements FSDP2's all-gather of its "
            "dim-0 shards and nothing else (no tensor-parallel split across its blocks, no broadcast or "
            "all-reduce of the frozen 4-bit base for DDP, pipeline stages or HSDP's replicas)",
            hint="run QLoRA with --parallel.dp_impl=fsdp (and no tp/pp/cp/ep), in one process, or use bf16 "
            "LoRA (finetune.quantize_base=none) on that layout",
        )


def _check_fp8(cfg: Config) -> None:
    """What rules precision.fp8 out from the config alone: torchao missing (found, not imported: it is imported
    only by the model's conversion, loom/parallel/fp8.py), a precision or head it does not compose with. A GPU
    without float8 tensor cores: loom.parallel.fp8.check_device, once the device is known."""
    p = cfg.precision
    if p.fp8 == "off":
        return
    if p.dtype == "fp16":
        raise LoomError(
            "precision.fp8 with precision.dtype=fp16: float8 training runs beside bf16 or fp32 (no loss scaling)",
            hint="use precision.dtype=bf16",
        )
    if p.fp8_head and cfg.model.tie_embeddings:
        raise LoomError(
            "precision.fp8_head=true but the head is the token embedding (model.tie_embeddings=true): the "
            "embedding is a lookup torchao does not convert, and the shared weight cannot be both",
            hint="leave precision.fp8_head=false, or untie the head (a Llama family)",
        )
    if p.fp8_head and cfg.parallel.tp > 1:
        raise LoomError(
            "precision.fp8_head=true with parallel.tp > 1 is not supported: the vocabulary-parallel head masks "
            "its shard of the logits in place, which the float8 matmul's output does not allow",
            hint="leave precision.fp8_head=false under tensor parallel",
        )
    if importlib.util.find_spec("torchao") is None:
        raise LoomError(
            f"precision.fp8={p.fp8} needs torchao, which is not installed",
            hint="install loom's fp8 extra: pip install 'loom[fp8]' (torchao >= 0.18), or precision.fp8=off",
        )


def rank_list(text: str, world: int) -> list[int]:
    """train.profile_ranks as ranks: 'all', or a comma list of ranks below `world`."""
    if text.strip() == "all":
        return list(range(world))
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise LoomError(
            f"train.profile_ranks must be all or a list of ranks such as 0,3; got '{text}'"
        ) from None
    if not ranks or ranks[0] < 0 or ranks[-1] >= world:
        raise LoomError(f"train.profile_ranks={text}: the job has ranks 0-{world - 1}", hint="use all, or 0")
    return ranks


def step_list(text: str, key: str) -> list[int]:
    """A comma list of steps (train.memory_snapshot_steps)."""
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise LoomError(f"{key} must be a list of steps such as 5,100; got '{text}'") from None
    if any(s < 1 for s in steps):
        raise LoomError(f"{key}: steps start at 1; got '{text}'")
    return steps


def _check_diagnostics(cfg: Config, world: int) -> None:
    """The profiler's ranks, the memory snapshot's steps."""
    t = cfg.train
    if t.profile_start:
        rank_list(t.profile_ranks, world)
    steps = step_list(t.memory_snapshot_steps, "train.memory_snapshot_steps")
    if t.memory_snapshot == "steps" and not steps:
        raise LoomError(
            "train.memory_snapshot=steps needs train.memory_snapshot_steps",
            hint="add --train.memory_snapshot_steps=5 (or use on_oom)",
        )


def _within(v: Any, bounds: Any) -> bool:
    if "also" in bounds and v == bounds["also"]:
        return True
    low = v > bounds["gt"] if "gt" in bounds else v >= bounds.get("ge", v)
    high = v < bounds["lt"] if "lt" in bounds else v <= bounds.get("le", v)
    return low and high


def _bound_message(key: str, v: Any, bounds: Any) -> str:
    if "lt" in bounds or "le" in bounds:  # an interval
        low = f"({bounds['gt']}" if "gt" in bounds else f"[{bounds['ge']}"
        high = f"{bounds['lt']})" if "lt" in bounds else f"{bounds['le']}]"
        return f"{key} must be in {low}, {high}, got {v}"
    if "gt" in bounds:
        return f"{key} must be " + ("positive" if bounds["gt"] == 0 else f"> {bounds['gt']}") + f", got {v}"
    why = f" ({bounds['why']})" if "why" in bounds else ""
    return f"{key} must be >= {bounds['ge']}{why}, got {v}"


def _check_fields(cfg: Config) -> None:
    """Every field against its bounds (read from its metadata; floats also against nan and inf, which TOML and
    float() accept), then the rules between two fields."""
    sections = {s: getattr(cfg, s) for s in section_types()}
    own = cfg.model.__dict__.get("family_keys")  # the family's own keys: model.<key> too
    for s, sub in [*sections.items(), *([("model", own)] if own is not None else [])]:
        for f in fields(sub):
            key, v = f"{s}.{f.name}", getattr(sub, f.name)
            if "choices" in f.metadata and v not in f.metadata["choices"]:
                raise LoomError(f"{key} must be one of {', '.join(f.metadata['choices'])}; got '{v}'")
            if isinstance(v, float) and not math.isfinite(v):
                raise LoomError(f"{key} must be a finite number, got {v}")
            if not _within(v, f.metadata):
                msg = f.metadata["msg"].format(**sections) if "msg" in f.metadata else None
                raise LoomError(msg or _bound_message(key, v, f.metadata), hint=f.metadata.get("hint"))
    t = cfg.train
    if cfg.optim.end_lr() > cfg.optim.lr:
        raise LoomError(_LR.format(**sections), hint=_LR_HINT)
    if t.hellaswag_every and not t.hellaswag_data:
        raise LoomError(
            f"train.hellaswag_every={t.hellaswag_every} needs train.hellaswag_data (a HellaSwag JSONL)",
            hint="give --train.hellaswag_data=hellaswag_val.jsonl, or set train.hellaswag_every=0",
        )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_model_shape(m: ModelConfig) -> None:
    """Heads divide the width; the rules of the Llama-family options (grouped-query heads, RoPE's pairs)."""
    head = getattr(m, "head_size", 0) or m.n_embd // m.n_head  # the llama family's key, else n_embd / n_head
    if m.n_embd % m.n_head and not getattr(m, "head_size", 0):
        raise LoomError(
            f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}",
            hint=f"pick n_embd as a multiple of n_head, e.g. {m.n_head * max(1, m.n_embd // m.n_head)}",
        )
    if m.n_kv_head and m.n_head % m.n_kv_head:
        raise LoomError(
            f"model.n_head={m.n_head} is not divisible by model.n_kv_head={m.n_kv_head} (each key/value head "
            "serves the same number of query heads)",
            hint="pick n_kv_head among the divisors of n_head: " + _divisors(m.n_head),
        )
    if m.pos == "rope" and head % 2:
        raise LoomError(
            f"model.pos=rope needs an even head size; the head size is {head}",
            hint="change n_embd or n_head (or model.head_size)",
        )


def _check_doc_mask(cfg: Config) -> None:
    """data.doc_mask's rules: the documents are found in the input ids, which only the first pipeline stage
    sees; restarting positions need the documents."""
    d = cfg.data
    if d.doc_positions == "restart" and not d.doc_mask:
        raise LoomError(
            "data.doc_positions=restart needs data.doc_mask=true (positions restart at each document)",
            hint="add --data.doc_mask=true, or leave data.doc_positions=continue",
        )
    if d.doc_mask and cfg.parallel.pp > 1:
        raise LoomError(
            f"data.doc_mask=true is not supported with parallel.pp={cfg.parallel.pp}: the documents are found "
            "in the input ids, which later pipeline stages do not see",
            hint="use data.doc_mask=false, or parallel.pp=1 (tensor and data parallel work with it)",
        )


def _check_cp(cfg: Config, dp_impl: str) -> None:
    """Context parallel's rules (parallel.cp > 1): the sequence splits evenly (into 2 * cp chunks for ring),
    Ulysses' all-to-all splits the heads evenly, and the layouts and features not built with it yet are
    refused by name."""
    p, m, cp = cfg.parallel, cfg.model, cfg.parallel.cp
    if cp == 1:
        return
    if p.cp_impl == "ring":
        _check_ring(cfg)
    elif m.block_size % cp:
        raise LoomError(
            f"parallel.cp={cp} does not divide model.block_size={m.block_size} (each cp rank holds "
            "block_size / cp tokens of every sequence)",
            hint="pick cp among the divisors of block_size: " + _divisors(m.block_size),
        )
    kv = m.n_kv_head or m.n_head
    if p.cp_impl == "ulysses" and kv % (cp * p.tp):
        tp = f" x parallel.tp={p.tp}" if p.tp > 1 else ""
        per_tp = kv // p.tp if kv % p.tp == 0 else kv
        raise LoomError(
            f"parallel.cp={cp}{tp} with cp_impl=ulysses does not divide model.n_kv_head={kv} (Ulysses gives each "
            "cp rank whole key/value heads of the whole sequence, out of its tensor-parallel rank's heads)",
            hint=f"pick cp among the divisors of {per_tp} ({_divisors(per_tp)}), or use more key/value heads, "
            "or parallel.cp_impl=ring",
        )
    if p.sp and m.block_size % (cp * p.tp):
        raise LoomError(
            f"parallel.sp with cp={cp}: model.block_size={m.block_size} is not divisible by cp x tp = "
            f"{cp * p.tp} (sequence parallel splits each cp rank's chunk over the tp ranks)",
            hint="pick block_size, cp and tp so that cp x tp divides block_size",
        )
    if dp_impl == "mpi":
        raise LoomError(
            "parallel.cp > 1 does not compose with parallel.dp_impl=mpi (its exchanges run on torch.distributed)",
            hint="use parallel.dp_impl=ddp (or auto) with context parallel",
        )
    if dp_impl == "zero1":
        raise LoomError(
            "parallel.cp > 1 does not compose with parallel.dp_impl=zero1 (its optimizer shards over the "
            "data-parallel group; FSDP shards over dp_shard x cp)",
            hint="use parallel.dp_impl=fsdp (or zero2, or ddp) with context parallel",
        )
    if cfg.train.hellaswag_every:
        raise LoomError(
            "train.hellaswag_every does not run with parallel.cp > 1 yet (its forward passes are whole sequences)",
            hint="set train.hellaswag_every=0 and score the run afterwards with `loom eval`",
        )


def _check_ring(cfg: Config) -> None:
    """Ring attention's own rules: its load-balanced layout cuts every sequence into 2 * cp chunks, and
    what it does not build (document masks, dropout of the attention weights) is refused by name."""
    m, cp = cfg.model, cfg.parallel.cp
    if m.block_size % (2 * cp):
        fits = [str(d) for d in range(2, m.block_size // 2 + 1) if m.block_size % (2 * d) == 0]
        raise LoomError(
            f"parallel.cp={cp} with cp_impl=ring needs 2*cp = {2 * cp} to divide model.block_size="
            f"{m.block_size} (each cp rank holds two of 2*cp equal chunks of every sequence, one early and one "
            "late, so that causal attention costs every rank the same)",
            hint="pick cp among "
            + (", ".join(fits) or "(none: block_size is odd)")
            + ", or change block_size",
        )
    if cfg.data.doc_mask:
        raise LoomError(
            "data.doc_mask=true is not supported with parallel.cp_impl=ring (the ring's masks are causal only)",
            hint="use parallel.cp_impl=ulysses with document masks, or data.doc_mask=false",
        )
    if m.dropout:
        raise LoomError(
            f"model.dropout={m.dropout} is not supported with parallel.cp_impl=ring (the ring does not drop "
            "attention weights)",
            hint="use model.dropout=0, or parallel.cp_impl=ulysses",
        )


def _check_mesh(cfg: Config, world: int) -> int:
    """The data-parallel degree of `world` processes (tp innermost), after every rule of tensor and pipeline
    parallel."""
    p, m = cfg.parallel, cfg.model
    if world % (p.cp * p.tp * p.pp):
        raise LoomError(
            f"world size {world} is not divisible by parallel.cp x tp x pp = {p.cp} x {p.tp} x {p.pp}",
            hint=f"start a multiple of {p.cp * p.tp * p.pp} processes, or change cp/tp/pp",
        )
    check_tp_heads(m.n_head, m.n_kv_head or m.n_head, p.tp)
    if p.sp and p.tp == 1:
        raise LoomError(
            "parallel.sp=true needs parallel.tp > 1 (sequence parallel shards what TP replicates)"
        )
    if p.sp and m.block_size % p.tp:
        raise LoomError(f"parallel.sp: model.block_size={m.block_size} is not divisible by tp={p.tp}")
    stages = p.pp * (SCHEDULE_STAGES_PER_RANK[p.pp_schedule] if p.pp > 1 else 1)
    if m.n_layer < stages:
        raise LoomError(
            f"{stages} pipeline stages (pp={p.pp}, schedule {p.pp_schedule}) but only model.n_layer="
            f"{m.n_layer} layers: every stage needs at least one",
            hint="lower parallel.pp, use the gpipe or 1f1b schedule, or add layers",
        )
    if p.degree1_meshes and world == 1 and SCHEDULE_STAGES_PER_RANK[p.pp_schedule] > 1:
        raise LoomError(  # two local stages: torch's schedule cannot evaluate them
            f"parallel.degree1_meshes takes a 1-stage schedule; pp_schedule={p.pp_schedule} puts two "
            "stages on the one rank, which torch's schedule cannot evaluate",
            hint="use parallel.pp_schedule=1f1b or gpipe",
        )
    if cfg.precision.dtype == "fp16" and p.pp > 1:
        raise LoomError(
            "precision.dtype=fp16 (loss scaling) is not supported with pp > 1",
            hint="use bf16 or fp32 with pipeline parallel",
        )
    return world // (p.cp * p.tp * p.pp)


def check_tp_heads(n_head: int, n_kv_head: int, tp: int) -> None:
    """Tensor parallel splits whole heads: tp divides the query heads and the key/value heads. The one check,
    made by validate() and by a family's parallel plan (handed tp directly)."""
    if n_head % tp:
        raise LoomError(
            f"parallel.tp={tp} does not divide model.n_head={n_head} (each rank holds whole heads)",
            hint="pick tp among the divisors of n_head: " + _divisors(n_head),
        )
    if n_kv_head % tp:
        raise LoomError(
            f"parallel.tp={tp} does not divide model.n_kv_head={n_kv_head} (each rank holds whole key/value "
            "heads)",
            hint="pick tp among the divisors of n_kv_head: " + _divisors(n_kv_head),
        )


def _resolve_dp_impl(cfg: Config, world: int, dp: int, dp_impl: str | None) -> str:
    """The data-parallel implementation `world` processes run: auto is ddp with more than one process (or a
    split model), else none; none with a split model and no data parallelism runs ddp's code on 1-rank groups."""
    p = cfg.parallel
    impl = dp_impl or p.dp_impl
    split = p.tp * p.pp > 1 or (p.degree1_meshes and world == 1)  # the model is split (or at degree 1)
    if impl == "none" and dp > 1:
        raise LoomError(
            f"{world} processes with parallel.dp_impl=none leave a data-parallel degree of {dp}",
            hint="use parallel.dp_impl=ddp (or auto), or start "
            + ("one process" if p.tp * p.pp == 1 else f"tp x pp = {p.tp * p.pp} processes"),
        )
    if p.tp * p.pp > 1 and impl in ("zero1", "mpi"):
        raise LoomError(
            f"parallel.dp_impl={impl} does not compose with tp/pp",
            hint="use parallel.dp_impl=ddp or fsdp (or zero2) with tensor/pipeline parallel",
        )
    if impl == "auto":
        return "ddp" if world > 1 or split else "none"
    # a split model, or cp ranks (which average their gradients), run ddp's code even at dp = 1
    return "ddp" if impl == "none" and (split or p.cp > 1) else impl


def _dp_degrees(p: ParallelConfig, dp: int, dp_impl: str) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for a data-parallel degree dp: HSDP's split for fsdp/zero2 (dp_shard=-1 takes
    what dp_replicate leaves); every other implementation replicates over all of dp."""
    if dp_impl not in SHARDED:
        if p.diloco_inner_steps and dp % p.dp_replicate == 0 and p.dp_shard in (-1, dp // p.dp_replicate):
            return p.dp_replicate, dp // p.dp_replicate  # DiLoCo's replicas, each a ddp group of dp_shard
        if p.dp_shard not in (-1, 1) or p.dp_replicate != 1:
            raise LoomError(
                f"parallel.dp_replicate/dp_shard split FSDP's data-parallel ranks (HSDP); dp_impl={dp_impl} "
                "replicates the model on every data-parallel rank",
                hint="use parallel.dp_impl=fsdp (or zero2) for HSDP, or leave dp_replicate/dp_shard unset",
            )
        return dp, 1
    shard = dp // p.dp_replicate if p.dp_shard == -1 else p.dp_shard
    if p.dp_replicate * shard != dp:
        raise LoomError(
            f"parallel.dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} must equal the data-parallel degree "
            f"{dp} (world / (tp x pp))",
            hint="pick dp_replicate among the divisors of " + f"{dp} and leave dp_shard=-1",
        )
    return p.dp_replicate, shard


def derive_batch(cfg: Config, dp_size: int) -> Derived:
    """Gradient accumulation, or with pp > 1 the schedule's micro-batches, from the global batch over dp_size
    data-parallel ranks."""
    t, p = cfg.train, cfg.parallel
    if t.batch_size % dp_size:
        raise LoomError(
            f"train.batch_size={t.batch_size} is not divisible by the data-parallel size {dp_size}",
            hint=f"use a batch_size that is a multiple of {dp_size}, or fewer processes",
        )
    schedule = check_schedules(cfg, dp_size)  # train.batch_schedule / seq_schedule (None: neither)
    micro = micro_windows(t, dp_size, schedule)  # 0: the smallest batch's share of a rank
    per_step = micro * dp_size
    if t.batch_size % per_step:
        raise LoomError(
            f"train.batch_size={t.batch_size} is not divisible by train.micro_batch_size={t.micro_batch_size}"
            f" x data-parallel size {dp_size} = {per_step}",
            hint="make batch_size a multiple of micro_batch_size * dp (gradient accumulation fills the rest)",
        )
    tokens = t.batch_size * cfg.model.block_size
    if p.pp == 1:
        return Derived(dp_size, t.batch_size // per_step, tokens, micro, schedule=schedule)
    # Pipeline: the schedule's micro-batches replace gradient accumulation.
    local = t.batch_size // dp_size
    n_mb = p.pp_microbatches or local // micro
    if not p.pp_microbatches and not t.micro_batch_size:
        # Neither set: the fewest micro-batches the schedule runs well, one per stage (a multiple of pp for the
        # looped schedules) that divides the local batch, not one micro-batch that leaves the stages idle.
        looped = SCHEDULE_STAGES_PER_RANK[p.pp_schedule] > 1
        fits = [n for n in range(p.pp, local + 1) if local % n == 0 and not (looped and n % p.pp)]
        n_mb = fits[0] if fits else n_mb
    if n_mb < 1 or local % n_mb:
        raise LoomError(f"parallel.pp_microbatches={n_mb} does not divide the local batch {local}")
    if p.pp_schedule != "gpipe" and n_mb < p.pp:
        raise LoomError(
            f"{n_mb} pipeline micro-batches for {p.pp} stages: schedule {p.pp_schedule} needs at least one per "
            "stage",
            hint=f"set parallel.pp_microbatches >= {p.pp} (or a smaller train.micro_batch_size)",
        )
    if SCHEDULE_STAGES_PER_RANK[p.pp_schedule] > 1 and n_mb % p.pp:  # the looped schedules
        raise LoomError(f"schedule {p.pp_schedule} needs pp_microbatches ({n_mb}) divisible by pp={p.pp}")
    return Derived(dp_size, 1, tokens, local // n_mb, n_mb)


# model.* keys that do not change what a trained model computes: where its first weights came from, and
# dropout, which evaluation, sampling and export switch off.
_NOT_THE_MODEL = ("init_from", "dropout")


# finetune.* keys that change what a checkpoint holds or what its model computes (LoRA's adapters, their scale,
# which linears carry them, whether the embedding and head train, an NF4 base); lora_dropout changes training
# only, and init_optimizer acts at a run's start only
_FINETUNE_MODEL = ("lora_rank", "lora_alpha", "lora_targets", "lora_embeddings", "quantize_base")
_FINETUNE_TRAINING = ("lora_dropout",)


def check_model_config(
    saved: dict, cfg: Config, source: str, hint: str, *, inference: bool = False, finetune: dict | None = None
) -> None:
    """The one check of a saved model against a config: `saved` is the "model" section a checkpoint recorded
    (state.json, or a consolidated file's metadata; a key it lacks, newer than the save, counts as its
    default), `finetune` its "finetune" section when it recorded one. Every key that differs is named
    (saved -> config; inference: the run's and the checkpoint's values) in a LoomError ("`source` was trained
    with another model shape: ...", with `hint`). inference: only the keys that change the shapes or the
    numerics of a forward pass (not _NOT_THE_MODEL; finetune's _FINETUNE_MODEL); training (resume) compares
    every model key and finetune's _FINETUNE_TRAINING too."""
    # a resume changes the config from the saved one (saved -> config); a finished run's config.toml should
    # say what its checkpoint holds (run vs checkpoint)
    say = (
        (lambda k, a, b: f"{k}: {b!r} in the run, {a!r} in the checkpoint")
        if inference
        else (lambda k, a, b: f"{k}: {a!r} -> {b!r}")
    )
    mine = cfg.to_dict()
    diff = _differing("model", saved, mine["model"], lambda k: not (inference and k in _NOT_THE_MODEL))
    if finetune is not None:
        keys = _FINETUNE_MODEL + (() if inference else _FINETUNE_TRAINING)
        diff += _differing("finetune", finetune, mine["finetune"], lambda k: k in keys)
    if diff:
        what = "another model shape" if diff[0][0].startswith("model.") else "other fine-tuning settings"
        raise LoomError(f"{source} was trained with {what}: " + "; ".join(say(*d) for d in diff), hint=hint)


def check_saved_config(saved: dict, cfg: Config, source: str, hint: str, *, inference: bool = False) -> None:
    """check_model_config of a checkpoint's whole recorded config (state.json's "config"): model.* and
    finetune.*."""
    check_model_config(
        saved.get("model", {}), cfg, source, hint, inference=inference, finetune=saved.get("finetune")
    )
    if not inference:
        _check_saved_low_comm(saved.get("parallel", {}), cfg, source)


def _check_saved_low_comm(saved: dict, cfg: Config, source: str) -> None:
    """A resumed run keeps the DiLoCo period and PowerSGD's rank its checkpoint holds state for: the outer
    momentum and the replicas' inner states belong to H (changing it is another optimizer mid-run), and P, Q and
    the error feedback are shaped by the rank. DiLoCo may be switched off (H=0): the run goes on as plain
    training from replica 0's weights and inner state (the checkpoint is written where the replicas agree)."""
    was = {**Config().to_dict()["parallel"], **saved}
    p = cfg.parallel
    h0, h = was["diloco_inner_steps"], p.diloco_inner_steps
    if h and h != h0:
        raise LoomError(
            f"{source} was trained with parallel.diloco_inner_steps={h0}, not {h}"
            + (": a run without DiLoCo cannot become one on resume" if not h0 else ""),
            hint=f"resume with --parallel.diloco_inner_steps={h0} (or 0 to continue as plain training), or start "
            "a new run"
            if h0
            else "resume it without parallel.diloco_inner_steps, or start a new run with it",
        )
    both = was["grad_compression"] == p.grad_compression == "powersgd"
    if both and was["powersgd_rank"] != p.powersgd_rank:
        raise LoomError(
            f"{source} was trained with parallel.powersgd_rank={was['powersgd_rank']}, not {p.powersgd_rank}: "
            "the PowerSGD state it holds (each matrix's low-rank factors and error feedback) has that rank",
            hint=f"resume with --parallel.powersgd_rank={was['powersgd_rank']}, or with "
            "--parallel.grad_compression=none, or start a new run",
        )


def _differing(section: str, saved: dict, mine: dict, compared) -> list[tuple[str, object, object]]:
    """(section.key, saved value, config value) of each compared key that differs; a key the save lacks (newer
    than it) counts as its default."""
    defaults = {**Config().to_dict()[section], **(_family_defaults(mine) if section == "model" else {})}
    saved = {**defaults, **{k: v for k, v in saved.items() if k in defaults}}
    return [(f"{section}.{k}", saved[k], v) for k, v in mine.items() if compared(k) and saved[k] != v]


def _family_defaults(model: dict) -> dict:
    """The defaults of the own keys of `model`'s family (a dict of the model section): what a save that
    predates one of them counts as."""
    section = FAMILY_SECTIONS.get(model.get("family"))
    if section is None or section.keys is None:
        return {}
    return {f.name: f.default for f in fields(section.keys)}
