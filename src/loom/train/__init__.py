"""Training: setup (device, data, run directory), the Trainer, and `run()` that ties them together."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from loom import checkpoint, log
from loom.config import (
    Config,
    Derived,
    config_from_dict,
    diff_configs,
    read_config,
    validate,
)
from loom.config.layout import ParallelDims
from loom.distributed.comm import Control
from loom.env import DistEnv, detect_env, restart_count
from loom.errors import LoomError, PeerError
from loom.train.resolve import (
    check_checkpoint_model,
    resolve_config,
    resolve_run_data,
    resume_checkpoint,
)
from loom.train.setup import resolve_device, resolve_run_dir, resumed_config
from loom.train.trainer import Trainer


@dataclass(frozen=True)
class RunRequest:
    """What `loom train` was asked, built once by the command line: the config as parsed, --resume (None: start
    a run; True: continue this run; a path: continue that run or checkpoint), --force, and the keys the user set
    (in the file or on the command line), which win over a resumed run's saved config."""

    cfg: Config
    resume: str | bool | None = None
    force: bool = False
    explicit: frozenset[str] = frozenset()


@dataclass
class Plan:
    cfg: Config
    derived: Derived
    run_dir: Path
    data_dir: Path
    ckpt: Path | None
    resume: str | bool | None = None  # as given (or chosen by train.resume=auto)
    origin: dict | None = None  # the run's identity and its base (loom.runs.origin): run.json, state.json


def plan_run(
    req: RunRequest,
    dims: ParallelDims,
    hashes: bool = True,
    layout: tuple[Config, Derived] | None = None,
    restarts: int | None = None,
) -> Plan:
    """Every cheap check, asked of three owners (loom.train.resolve) in the order that touches the least: the
    config (on the job's layout `dims`; `layout`: the config layout_config resolved from the same request and
    what validate() derived of it), the checkpoint, the data. `hashes=False`: checkpoint files are checked for presence and size only; the
    ranks of the job then hash them together (`check_hashes`). `restarts`: the job's DistEnv.restarts (None:
    read from the environment here)."""
    from loom.runs import origin

    share = (0, 1) if hashes else None
    restarted = (restart_count() if restarts is None else restarts) > 0
    resolved = auto_resume(req, share, restarted)
    # the layout's config is this request's own unless train.resume=auto changed what the request continues
    cfg, derived, run_dir = resolve_config(resolved, dims, layout if resolved == req else None)
    ckpt = resume_checkpoint(run_dir, resolved.resume, cfg, share, restarted) if resolved.resume else None
    data_dir = resolve_run_data(cfg, run_dir, ckpt)
    if run_dir is None:
        run_dir = resolve_run_dir(cfg, None, resolved.force, (data_dir,))
    return Plan(cfg, derived, run_dir, data_dir, ckpt, resolved.resume, origin(cfg, ckpt, run_dir))


def check_hashes(control: Control, plan: Plan) -> Plan:
    """Every rank hashes its share of the resumed checkpoint's files (`checkpoint.hash_owner`: on the layout
    that wrote them, each rank the shards it wrote and reads back), instead of one rank hashing them all.
    A bad file, reported by whichever rank found it, falls back to the newest older checkpoint, which the
    ranks hash the same way, or is an error when that step was named by --resume."""
    if plan.ckpt is None:
        return plan
    errors = checkpoint.share_errors(plan.ckpt, control)
    if errors is None:
        return plan

    def refuse_named_step() -> None:
        if checkpoint.names_step(plan.resume):
            raise LoomError(
                next(e for e in errors if e),
                hint="resume from the run directory to fall back to its newest valid step",
            )
        for e in errors:
            if e:
                log.warn(f"skipping checkpoint: {e}")

    rank0_result(control, refuse_named_step)
    steps = checkpoint.list_steps(plan.ckpt.parent)
    names = [p.name for p in steps]
    older = steps[: names.index(plan.ckpt.name)] if plan.ckpt.name in names else []
    found = checkpoint.newest_intact(older, control)

    def check_found() -> Path:
        if found is None:
            raise LoomError(
                f"--resume: no valid checkpoint under '{plan.ckpt.parent}'", hint="start without --resume"
            )
        check_checkpoint_model(found, plan.cfg)
        return found

    return replace(plan, ckpt=rank0_result(control, check_found))


def auto_resume(req: RunRequest, share=(0, 1), restarted: bool | None = None) -> RunRequest:
    """The request after train.resume=auto and elastic restarts (its resume and force).

    auto continues run.dir/run.name from its newest valid checkpoint, or starts it (again, when a run
    with the same config died before its first checkpoint). A worker restarted by an elastic agent
    (TORCHELASTIC_RESTART_COUNT > 0) behaves as auto, and continues from the newest checkpoint of its run
    rather than the one first named by `--resume PATH`. `restarted`: whether this is such a worker (None: read
    from the environment).
    """
    restarted = restart_count() > 0 if restarted is None else restarted
    cfg, resume = req.cfg, req.resume
    if cfg.train.resume != "auto" and not restarted:
        return req
    if resume is not None:
        if restarted and isinstance(resume, str):
            p = Path(resume)
            run_dir = p.parent.parent if p.parent.name == "ckpt" else p
            if checkpoint.latest_valid(run_dir / "ckpt", share=share) is not None:
                return replace(req, resume=str(run_dir))
        return req
    if not cfg.run.name:
        if cfg.train.resume == "auto":
            raise LoomError(
                "train.resume=auto needs a run.name to find the run again",
                hint="add --run.name=NAME (the same name on every launch)",
            )
        return req
    run_dir = Path(cfg.run.dir) / cfg.run.name
    if checkpoint.latest_valid(run_dir / "ckpt", share=share) is not None:
        log.info(
            f"continuing {run_dir} from its newest valid checkpoint" + (" (restart)" if restarted else "")
        )
        return replace(req, resume=True)
    saved = run_dir / "config.toml"
    # the start mode is not part of what the run is: a run started plainly (or with --resume) that died before
    # its first complete checkpoint (a save killed half way leaves only step_N.tmp) is started again by auto
    before = read_config(saved) if saved.is_file() else None
    if before is not None and not [
        d
        for d in diff_configs(before, _as_saved(cfg, req.explicit, before))
        if not d.startswith("train.resume:")
    ]:
        log.warn(f"{run_dir} has no valid checkpoint: starting it again")
        return replace(req, force=True)
    return req


def _as_saved(cfg: Config, explicit: frozenset[str], saved: Config) -> Config:
    """The config as the run saved it: with model.init_from=run:DIR, DIR's model keys applied (to a copy), as
    plan_run applies them before the run starts, and run:DIR read as the checkpoint of DIR the run was pinned
    to (`saved`'s). Compared without them, a fine-tuning run never equalled its own config.toml:
    train.resume=auto (and an elastic restart) refused to start again a LoRA/SFT run that died before its first
    checkpoint, where a pretraining run is started again (its folder, metrics.jsonl too, replaced)."""
    from loom.runs import is_run_init, same_base

    if not is_run_init(cfg):
        return cfg
    import copy

    from loom.train import finetune

    mine = copy.deepcopy(cfg)
    finetune.apply_run_init(mine, set(explicit))
    if same_base(saved.model.init_from, mine.model.init_from):
        mine.model.init_from = saved.model.init_from
    return mine


def layout_config(req: RunRequest) -> Config:
    """The config whose parallel layout this job runs: on resume the saved one (command-line keys win).
    Only reads files, so every rank can call it before any process group exists."""
    if not req.resume:
        return req.cfg
    return resumed_config(resolve_run_dir(req.cfg, req.resume, req.force), req.cfg, req.explicit)


def job_dims(cfg: Config, env: DistEnv) -> ParallelDims:
    """This rank's layout in the launcher's world, after every rule of config.validate() (before any process
    group); a layout whose frequent collectives cross nodes is warned about."""
    return job_layout(cfg, env)[1]


def job_layout(cfg: Config, env: DistEnv) -> tuple[Derived, ParallelDims]:
    """job_dims, with the values validate() derived of the config (plan_run uses them instead of validating
    the same config again)."""
    derived, dims = validate(cfg, env.world_size, env.rank)
    if dims.dp_impl != "mpi":
        check_node_layout(dims, env)
    return derived, dims


def check_node_layout(dims: ParallelDims, env: DistEnv) -> None:
    """Warn (rank 0) when a layout sends frequent collectives across nodes: tp and dp_shard belong within one."""
    per_node = env.local_world_size
    if env.num_nodes <= 1 or per_node <= 0:
        return
    if dims.tp > per_node:
        log.warn(
            f"parallel.tp={dims.tp} is larger than the {per_node} processes per node: tensor-parallel "
            "all-reduces (two per layer, forward and backward) cross nodes"
        )
    elif dims.fsdp_enabled and dims.dp_shard * dims.tp > per_node:
        log.warn(
            f"parallel.dp_shard={dims.dp_shard} x tp={dims.tp} spans more than the {per_node} processes per node: "
            "FSDP's all-gathers and reduce-scatters (every layer) cross nodes; HSDP keeps them within one "
            f"(e.g. parallel.dp_replicate={env.num_nodes} for one replica per node when pp=1)"
        )


def build_layout(dims: ParallelDims, env: DistEnv, cfg: Config, device) -> tuple[ParallelDims, Control]:
    """The job's layout (`dims` from job_dims; with dp_impl=mpi, MPI's world) and its control plane; joins the
    process group (or MPI's world) where one is needed."""
    from loom.distributed import process_group
    from loom.distributed.comm import MpiControl, TorchControl

    p = cfg.parallel
    if dims.dp_impl == "mpi":
        from loom.parallel.mpi_dp import mpi_comm

        comm = mpi_comm()
        size = comm.Get_size()
        if size < env.world_size:  # processes started by another launcher: each its own 1-process world
            raise LoomError(
                f"parallel.dp_impl=mpi but MPI sees {size} process(es) where {env.source} started "
                f"{env.world_size}: they would train separately into the same run",
                hint=f"start MPI jobs with mpiexec -n {env.world_size} loom train ... (or loom launch)",
            )
        if size != env.world_size:
            log.warn(f"MPI world size {size} differs from the launcher's {env.world_size} ({env.source})")
        if size == 1:
            log.warn("parallel.dp_impl=mpi with one process (not started by mpiexec?): training alone")
        return ParallelDims(size, 1, 1, 1, size, comm.Get_rank(), "mpi"), MpiControl(comm)
    if dims.fsdp_enabled:  # FSDP's options, before joining the group
        from loom.parallel.fsdp import mp_policy

        mp_policy(p.param_dtype, p.reduce_dtype, device, "fp32")
    if dims.dp_impl == "none":
        return dims, Control()
    process_group.init(env, device, p.timeout_s)
    return dims, TorchControl()


def ft_layout(cfg: Config, derived: Derived):
    """ft.enabled: this replica group's rows and DDP's batch sizes (loom.distributed.ft); else (None, derived)."""
    if not cfg.ft.enabled:
        return None, derived
    from loom.distributed.ft import replica_layout

    return replica_layout(cfg)


def build_trainer(plan: Plan, device, dims: ParallelDims, control: Control, ft_part=None) -> Trainer:
    """The trainer of the plan, its checkpoint loaded; `ft_part` (ft.enabled): a torchft replica group's
    rows, and its manager joined to the lighthouse (the first step's quorum heals a group that restarted)."""
    trainer = Trainer(
        plan.cfg,
        plan.derived,
        plan.run_dir,
        plan.data_dir,
        device,
        dims,
        control,
        plan.origin,
        plan.ckpt,
        ft_part,
    )
    if plan.ckpt is not None:
        trainer.load(plan.ckpt)
    if ft_part is not None:
        from loom.distributed.ft import FtReplica

        trainer.ft = FtReplica(plan.cfg, trainer)
    return trainer


def shutdown(dims: ParallelDims, control: Control, clean: bool) -> None:
    """Every rank waits for the others (rank 0 may still be sampling or saving) before leaving."""
    if dims.dp_impl == "mpi":
        if clean:
            control.barrier()
        return
    from loom.distributed import process_group

    process_group.shutdown(clean, destroy_timeout_s=30.0 if clean else 1.0)  # failed: leave promptly


def rank0_result(control: Control, fn):
    """Rank 0 runs fn (checks, run-dir choice) and every rank receives its result or its error."""
    result = error = None
    if control.rank == 0:
        try:
            result = fn()
        except LoomError as e:
            error = e
    result, msg = control.broadcast_object((result, str(error) if error else None))
    if error is not None:
        raise error
    if msg is not None:
        raise PeerError(msg)
    return result


def check_same_config(control: Control, cfg: Config) -> None:
    """Rank 0 broadcasts its resolved config; a rank that parsed a different one names the keys."""
    if control.size == 1:
        return
    diff = diff_configs(config_from_dict(control.broadcast_object(cfg.to_dict())), cfg)
    bad = int(control.all_reduce_sum([1.0 if diff else 0.0])[0])
    if diff:
        raise LoomError(
            f"rank {control.rank}'s config differs from rank 0's: " + "; ".join(diff),
            hint="start every rank with the same command line and config file",
        )
    if bad:
        raise PeerError(f"{bad} rank(s) were started with a config that differs from rank 0's")


def run(req: RunRequest | Config, log_all_ranks: bool = False) -> dict:
    """`loom train` in this process, alone or as one rank of a job (a Config alone: a new run). Returns the
    summary."""
    req = req if isinstance(req, RunRequest) else RunRequest(req)
    cfg, env = req.cfg, detect_env()
    log.setup(rank=env.rank, all_ranks=log_all_ranks)
    layout = layout_config(req)  # the saved layout when resuming
    derived, dims = job_layout(
        layout, env
    )  # every rule of the config and the layout, before any process group
    ft_part, derived = ft_layout(layout, derived)
    device = resolve_device(cfg.train.device, env.local_rank)
    dims, control = build_layout(dims, env, layout, device)
    clean, trainer = False, None
    try:
        if env.world_size > 1:
            log.info(f"launcher {env.launched_by}: {env}")
        check_same_config(control, cfg)
        many = control.size > 1
        plan = rank0_result(control, lambda: plan_run(req, dims, not many, (layout, derived), env.restarts))
        if many:
            plan = check_hashes(control, plan)
        if plan.cfg.run.rank_logs:
            log.setup(
                rank=env.rank, all_ranks=log_all_ranks, file=plan.run_dir / "logs" / f"rank{env.rank}.log"
            )
        log.info(
            f"global batch {plan.cfg.train.batch_size} x {plan.cfg.model.block_size} = "
            f"{plan.derived.tokens_per_step:,} tokens/step | micro-batch {plan.derived.micro_batch_size}"
            f" | grad accum {plan.derived.grad_accum} | {dims.describe()}"
        )
        trainer = build_trainer(plan, device, dims, control, ft_part)
        if env.world_size > 1 and dims.dp_impl != "mpi":
            from loom.distributed.health import Heartbeat

            try:  # only for naming the ranks a failed collective waited for: never a reason to stop
                trainer.heartbeat = Heartbeat(env.rank, env.world_size)
            except Exception as e:
                log.warn(
                    f"rank {env.rank}: no heartbeat in the job's store ({e}); a hang will not name ranks"
                )
        summary = trainer.train()
        clean = True
        return summary
    except Exception as e:
        from loom.distributed.health import describe_failure, is_comm_error

        if env.world_size > 1 and not isinstance(e, LoomError) and is_comm_error(e):
            op, step = (trainer.op, trainer.op_step) if trainer else ("the setup broadcast", 0)
            hb = trainer.heartbeat if trainer else None
            raise describe_failure(e, env.rank, op, step, cfg.parallel.timeout_s, hb) from None
        raise
    finally:
        shutdown(dims, control, clean)
