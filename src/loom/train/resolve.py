"""Resolving a run request before anything is built: three owners, asked in the order that touches the least.

- the config (`resolve_config`): which run (continued, or new), the config it trains with (a resumed run's
  saved one, the user's keys winning; model.init_from's shape), every rule of validate() on the job's layout,
  the trackers and the device;
- the checkpoint (`resume_checkpoint`): the one --resume names, of this model, not already finished;
- the data (`resolve_run_data`): the data directory, the run's tokenizer, and what fine-tuning asks of it.

Each owner reads its files once and runs its own checks; `loom.train.plan_run` asks the three in turn.
"""

from __future__ import annotations

from pathlib import Path

from loom import checkpoint, log
from loom.config import Config, Derived, check_saved_config, validate
from loom.config.layout import ParallelDims
from loom.env import restart_count
from loom.errors import LoomError
from loom.train import finetune
from loom.train.setup import (
    check_writable,
    resolve_data_meta,
    resolve_device,
    resolve_run_dir,
    resumed_config,
)


def resolve_config(
    req, dims: ParallelDims, layout: tuple[Config, Derived] | None = None
) -> tuple[Config, Derived, Path | None]:
    """(the config the run trains with, its derived values, the run directory it continues or None). `req`:
    the loom.train.RunRequest after train.resume=auto; `layout`: the config the job already resolved for its
    layout from the same request (loom.train.layout_config) and what validate() derived of it, used instead
    of reading the saved config and validating it again."""
    from loom.metrics import check_trackers

    cfg, run_dir = req.cfg, None
    if req.resume:
        run_dir = resolve_run_dir(cfg, req.resume, req.force)
        cfg = layout[0] if layout is not None else resumed_config(run_dir, cfg, req.explicit)
    finetune.resolve_init_from(cfg, req.explicit)
    # validated already unless model.init_from changed its shape or MPI's world replaced the launcher's
    same = layout is not None and layout[0] is cfg and not cfg.model.init_from and dims.dp_impl != "mpi"
    derived = layout[1] if same else validate_on(cfg, dims)
    check_trackers(cfg.metrics)
    resolve_device(cfg.train.device)
    finetune.check_lora_targets(cfg)
    return cfg, derived, run_dir


def validate_on(cfg: Config, dims: ParallelDims) -> Derived:
    """validate() of the config a run trains with on the layout its job was given (the same but for a run that
    train.resume=auto continues, whose saved layout the job could not know before it started)."""
    derived, planned = validate(cfg, dims.world_size, dims.rank, dims.dp_impl)
    if (planned.tp, planned.pp) != (dims.tp, dims.pp):
        raise LoomError(
            f"the run's config has parallel.tp={planned.tp}, parallel.pp={planned.pp} but this job was laid out "
            f"with tp={dims.tp}, pp={dims.pp}",
            hint="give its parallel.tp and parallel.pp on the command line, or continue it with --resume",
        )
    return derived


def resume_checkpoint(
    run_dir: Path, resume, cfg: Config, share=(0, 1), restarted: bool | None = None
) -> Path:
    """The checkpoint --resume names (`share`: see checkpoint.resolve_resume), refused when it holds another
    model or already reached train.steps (its state.json read once); `restarted`: as in check_not_finished."""
    ckpt, state = checkpoint.resume_state(run_dir, resume, share)
    check_checkpoint_model(ckpt, cfg, state)
    check_not_finished(ckpt, cfg, run_dir, state["step"], restarted)
    return ckpt


def check_checkpoint_model(ckpt: Path, cfg: Config, state: dict | None = None) -> None:
    """A checkpoint of another model shape is refused before anything is built (state.json only)."""
    state = checkpoint.read_state(ckpt) if state is None else state
    check_saved_config(
        state.get("config", {}),
        cfg,
        f"checkpoint '{ckpt}'",
        "resume with the checkpoint's model settings, or start a new run",
    )


def check_not_finished(
    ckpt: Path, cfg: Config, run_dir: Path, step: int, restarted: bool | None = None
) -> None:
    """--resume of a run whose checkpoint already reached train.steps would only print "resumed" and stop:
    an error that says how to extend it (a warning under train.resume=auto or an elastic restart, which
    may legitimately start a job again after it finished). `restarted`: whether it is one (None: read from the
    environment)."""
    if step < cfg.train.steps:
        return
    more = step + max(cfg.train.steps, 1)
    msg = (
        f"run '{run_dir}' already reached train.steps={cfg.train.steps} (checkpoint '{ckpt.name}' is at step "
        f"{step}): there is nothing left to train"
    )
    hint = f"to train further, resume with a larger train.steps, e.g. --resume --train.steps={more}"
    restarted = restart_count() > 0 if restarted is None else restarted
    if cfg.train.resume == "auto" or restarted:
        log.warn(f"{msg} ({hint})")
        return
    raise LoomError(msg, hint=hint)


def resolve_run_data(cfg: Config, run_dir: Path | None, ckpt: Path | None) -> Path:
    """The data directory (a new run's output folder checked first: the data may be the built-in corpus,
    prepared now); refused when a continued run was trained with another tokenizer; then what fine-tuning
    asks of the data (finetune.check_data)."""
    if run_dir is None:
        check_writable(Path(cfg.run.dir))
    saved = run_dir is not None and (run_dir / "tokenizer" / "meta.json").is_file()
    # the run's checkpoints were trained with its tokenizer: data with another (same size or not) is refused
    data_dir, meta = resolve_data_meta(cfg, run_dir / "tokenizer" if saved else None)
    finetune.check_data(cfg, data_dir, meta, starting=ckpt is None)
    return data_dir
