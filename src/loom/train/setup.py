"""Everything a run needs before its first step: device, data directory, run directory.

All of it is checked before any expensive work, and nothing that exists is overwritten unless asked.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from loom import checkpoint, device, log
from loom.config import Config, diff_configs, read_config
from loom.env import native_bf16_cpu
from loom.errors import LoomError
from loom.metrics import has_bf16
from loom.outputs import check_apart, claim_output
from loom.paths import cache_dir


def resolve_device(spec: str, local_rank: int = 0, key: str = "train.device") -> torch.device:
    """auto picks cuda > xpu > mps > cpu (<type>:<local rank> in a multi-process job); a missing device is an
    error. `key` is the option the spec came from, named in the message (train.device, or a command's --device).
    """
    if spec == "auto":
        kind = device.default_type()
        if kind != "cpu":
            return torch.device(kind, local_rank % device.count(kind))
        return torch.device("mps" if device.available("mps") else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise LoomError(
            f"{key} '{spec}' is not a device", hint="use auto, cpu, cuda, cuda:N or mps"
        ) from None
    fix = f"{key}=auto" if "." in key else f"{key} auto (or cpu)"
    if dev.type in ("cuda", "xpu", "mps") and not device.available(dev.type):
        what = dev.type.upper()
        raise LoomError(
            f"{key} {spec} asks for {dev.type} but no {what} device is available", hint=f"use {fix}"
        )
    n = device.count(dev.type)
    if dev.type in ("cuda", "xpu") and dev.index is not None and dev.index >= n:
        raise LoomError(f"{key} {spec}: this machine has {n} {dev.type.upper()} device(s)", hint=f"use {fix}")
    if dev.type in ("cuda", "xpu") and dev.index is None:  # each rank its own GPU (LOCAL_RANK), as with auto
        return torch.device(dev.type, local_rank % n)
    return dev


def resolve_precision(dtype: str, device: torch.device, loss_scaling: bool = True) -> str:
    """precision.dtype, with auto resolved for this device: bf16 on GPUs that have it (fp16 with loss scaling on
    older ones, as nanogpt chooses, unless the layout cannot scale the loss: pipeline parallel), bf16 on CPUs
    with bf16 units, fp32 elsewhere (emulated bf16 is slower)."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bf16" if has_bf16(device) else ("fp16" if loss_scaling else "fp32")
    return "bf16" if device.type == "cpu" and native_bf16_cpu() else "fp32"


def precision_reason(dtype: str, device: torch.device) -> str:
    """Why precision.dtype=auto chose `dtype` on this device: the run's first lines say it."""
    if device.type == "cuda":
        if dtype == "bf16":
            return "this GPU computes in bf16"
        return f"this GPU has no bf16{'; fp16 with loss scaling' if dtype == 'fp16' else ''}"
    if device.type == "cpu":
        if dtype == "bf16":
            return "this CPU has bf16 units (AVX512-BF16/AMX)"
        return "this CPU has no bf16 units (AVX512-BF16/AMX): bf16 would be emulated, slower than fp32"
    return f"no bf16 path checked on {device.type}"


def check_data_dir(path: str | Path, run_tok_dir: Path | None = None) -> dict:
    """Validate a data directory in any readable format (every shard opened) and return its meta; with
    `run_tok_dir` (a continued run's tokenizer folder), data prepared with another tokenizer is refused."""
    from loom.data.tokenizers import check_run_data

    return check_run_data(path, run_tok_dir)


def resolve_data_meta(cfg: Config, run_tok_dir: Path | None = None) -> tuple[Path, dict]:
    """resolve_data, and the data's meta (data.path's: the one check_data_dir read while checking it);
    `run_tok_dir`: as in check_data_dir."""
    if cfg.data.mix:
        return _mix_data(cfg, run_tok_dir)
    if cfg.data.path:
        return Path(cfg.data.path), check_data_dir(cfg.data.path, run_tok_dir)
    from loom.data.loader import read_meta

    data_dir = resolve_data(cfg)
    meta = read_meta(data_dir)
    if run_tok_dir is not None:
        from loom.data.tokenizers import check_run_tokenizer

        check_run_tokenizer(run_tok_dir, data_dir, meta)
    return data_dir, meta


def _mix_data(cfg: Config, run_tok_dir: Path | None = None) -> tuple[Path, dict]:
    """data.mix: every source checked (one vocabulary and tokenizer, the end-of-text id the options need), and
    the first's folder and meta, which stand for the run's data (its tokenizer, vocabulary, validation)."""
    from loom.data.mix import check_sources, mix_weights, parse_mix

    if cfg.data.path:
        raise LoomError(
            "data.path and data.mix are both set", hint="give the mixture's sources in data.mix only"
        )
    sources, weights = parse_mix(cfg.data.mix, cfg.data.sources)
    mix_weights(
        weights, cfg.data.mix_schedule, sources
    )  # a bad schedule fails here, before the data is opened
    metas = check_sources(sources, cfg.data.doc_mask, cfg.data.align)
    if run_tok_dir is not None:
        from loom.data.tokenizers import check_run_tokenizer

        for s, m in zip(sources, metas, strict=True):
            check_run_tokenizer(run_tok_dir, Path(s.path), m)
    return Path(sources[0].path), metas[0]


def resolve_data(cfg: Config, main_process: bool = True) -> Path:
    """data.path if given (data.mix: its first source), else the built-in corpus, prepared once into the cache."""
    if cfg.data.mix:
        return _mix_data(cfg)[0]
    if cfg.data.path:
        check_data_dir(cfg.data.path)
        return Path(cfg.data.path)
    from loom.data.corpus import cache_name
    from loom.data.prepare import prepare_corpus

    d = cfg.data
    tag = f"{cache_name(d.corpus)}-{d.tokenizer}" + (f"{d.vocab_size}" if d.tokenizer == "bpe" else "")
    out = Path(d.cache_dir or cache_dir()) / "data" / tag
    if not (out / "meta.json").is_file():
        from loom.paths import check_output_dir

        where = "LOOM_CACHE_DIR" if os.environ.get("LOOM_CACHE_DIR") else "~/.cache/loom"
        where = "data.cache_dir" if d.cache_dir else where
        check_output_dir(out, where, temp_beside=True)  # before the corpus is read and tokenized
        if not main_process:
            raise LoomError(f"the built-in corpus is not prepared at {out}", hint="run once with one process")
        # Two jobs started together (two `loom train` with no data) would both write the same temporary folder
        # and one rename it under the other: the first prepares, the others wait for it, then reuse it.
        with _exclusive(out.with_name(f".{out.name}.lock")):
            if not (out / "meta.json").is_file():
                log.info(f"preparing the built-in corpus '{d.corpus}' into {out} (once; later runs reuse it)")
                prepare_corpus(d.corpus, out, d.tokenizer, d.vocab_size, seed=cfg.run.seed)
            else:
                log.info(f"using the built-in corpus another job prepared meanwhile at {out}")
    else:
        log.info(f"using the prepared built-in corpus at {out}")
    check_data_dir(out)
    return out


@contextlib.contextmanager
def _exclusive(lock: Path):
    """An exclusive lock on the file `lock` (created if missing), held while the block runs; released when
    the process ends, however it ends (flock)."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _newest_run(parent: Path) -> Path | None:
    runs = [p for p in parent.iterdir() if (p / "ckpt").is_dir()] if parent.is_dir() else []
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def check_run_name(name: str) -> str:
    """A run name is one plain folder name: nothing that could write outside run.dir."""
    bad = (
        not name.strip()
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or name.startswith("-")
        or any(ord(c) < 32 for c in name)
    )
    if bad:
        raise LoomError(
            f"run.name {name!r} must be a plain folder name (no '/', '\\', '..', control characters or leading '-')",
            hint="use run.dir for the parent folder, e.g. --run.dir=runs --run.name=exp1",
        )
    return name


def check_writable(run_dir: Path) -> None:
    """The run directory (or the nearest parent that exists) must be writable, checked before any work."""
    p = run_dir
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise LoomError(f"cannot create run directory '{run_dir}': '{p}' is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise LoomError(
            f"run directory '{run_dir}' is not writable ('{p}' denies this user write access)",
            hint="choose a writable run.dir, or fix the folder's permissions",
        )


def resolve_run_dir(cfg: Config, resume: str | bool | None, force: bool, inputs: tuple = ()) -> Path:
    """The run directory. Refuses one that holds another run unless --resume or --force; --force replaces
    only a loom run, and never one that is or holds one of `inputs` (the data directory).

    `--resume PATH` (a run directory) resumes that run; bare `--resume` resumes run.dir/run.name, or the
    newest run under run.dir when no name is given.
    """
    parent = Path(cfg.run.dir)
    if isinstance(resume, str):
        p = Path(resume)
        run_dir = p.parent.parent if p.parent.name == "ckpt" else p
    elif resume:
        run_dir = parent / check_run_name(cfg.run.name) if cfg.run.name else _newest_run(parent)
        if run_dir is None:
            raise LoomError(
                f"--resume: no run with checkpoints under '{parent}'", hint="start without --resume"
            )
    else:
        run_dir = parent / check_run_name(cfg.run.name) if cfg.run.name else _unused_name(parent)
    if resume:
        if not run_dir.is_dir():
            what = "is not a directory" if run_dir.exists() else "does not exist"
            raise LoomError(f"--resume: run directory '{run_dir}' {what}")
        check_writable(run_dir)
        return run_dir
    check_writable(run_dir)
    if not force and run_dir.exists() and any(run_dir.iterdir()):  # refused: which run is there, first
        check_apart(run_dir, inputs, "run directory", inside_ok=True)  # its data is named before all else
        refuse_existing_run(run_dir, cfg)
    # --force must never delete the data it trains on; with --force only a loom run is replaced
    claim_output(run_dir, "run", force, "run directory", inputs, inside_ok=True)
    return run_dir  # created by the trainer once everything cheap has been checked


def _unused_name(parent: Path) -> Path:
    """A run without run.name is named by the second it starts in; a second run started in the same second
    (a script's next command) gets `-2`, `-3`, ... instead of being refused as another run's folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir, k = parent / stamp, 2
    while run_dir.exists() and any(run_dir.iterdir()):
        run_dir, k = parent / f"{stamp}-{k}", k + 1
    return run_dir


def refuse_existing_run(run_dir: Path, cfg: Config) -> None:
    """A new run's non-empty directory without --force: refused, naming the run it holds (its config's
    differences, whether it has a checkpoint to resume) or saying it holds no loom run."""
    if (run_dir / "config.toml").exists():
        diff = diff_configs(read_config(run_dir / "config.toml"), cfg)
        what = "a run with a different config (" + "; ".join(diff[:4]) + ")" if diff else "a run"
        hint = "pass --resume to continue it, --force to start over (deletes it), or pick another run.name"
        if checkpoint.latest_valid(run_dir / "ckpt", share=None) is None:  # sizes only: a cheap look
            what += " with no complete checkpoint"
            hint = (
                "nothing can be resumed: pass --force to start it over (deletes it), or pick another run.name"
            )
        raise LoomError(f"run directory '{run_dir}' already holds {what}", hint=hint)
    raise LoomError(f"run directory '{run_dir}' exists and is not a loom run", hint="pick another run.name")


def resumed_config(run_dir: Path, cfg: Config, explicit: set[str]) -> Config:
    """On resume the saved config is the base; keys the user set on this command line win."""
    from loom.runs import same_base

    saved = read_config(run_dir / "config.toml")
    for key in explicit:
        section, name = key.split(".", 1)
        if key == "model.init_from" and same_base(saved.model.init_from, cfg.model.init_from):
            continue  # the run was pinned to that run's checkpoint when it started: keep it
        setattr(getattr(saved, section), name, getattr(getattr(cfg, section), name))
    return saved
