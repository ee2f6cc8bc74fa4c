"""Training: setup (device, data, run directory), the Trainer, and `run()` that ties them together."""

from __future__ import annotations

from loom import checkpoint, log
from loom.config import Config, validate
from loom.train.setup import resolve_data, resolve_device, resolve_run_dir, resumed_config
from loom.train.trainer import LocalDP, Trainer


def run(cfg: Config, resume: str | bool | None = None, force: bool = False, explicit: set[str] | None = None) -> dict:
    """`loom train`: validate everything cheap first, then build and train. Returns the summary."""
    run_dir = resolve_run_dir(cfg, resume, force) if resume else None
    if run_dir is not None:
        cfg = resumed_config(run_dir, cfg, explicit or set())
    derived = validate(cfg)
    device = resolve_device(cfg.train.device)
    ckpt = checkpoint.resolve_resume(run_dir, resume) if resume else None
    data_dir = resolve_data(cfg)
    if run_dir is None:
        run_dir = resolve_run_dir(cfg, None, force)
    log.info(
        f"global batch {cfg.train.batch_size} x {cfg.model.block_size} = {derived.tokens_per_step:,} tokens/step"
        f" | micro-batch {cfg.train.micro_batch_size} | grad accum {derived.grad_accum} | dp {derived.dp_size}"
    )
    trainer = Trainer(cfg, derived, run_dir, data_dir, device, LocalDP())
    if ckpt is not None:
        trainer.load(ckpt)
    return trainer.train()
