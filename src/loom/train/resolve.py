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
    finetune.check_lora_targets(cfg, dims.fsdp_shard if dims.fsdp_enabled else 1)
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
    if ckpt is not None:
        check_data_kind(cfg, run_dir, ckpt)
    saved = run_dir is not None and (run_dir / "tokenizer" / "meta.json").is_file()
    # the run's checkpoints were trained with its tokenizer: data with another (same size or not) is refused
    data_dir, meta = resolve_data_meta(cfg, run_dir / "tokenizer" if saved else None)
    finetune.check_data(cfg, data_dir, meta, starting=ckpt is None)
    return data_dir


# The kinds of data a run trains on, each its own training stage (loom.train.stage): what a resume must keep.
DATA_KINDS = {
    "rl": "RL prompts (rl.prompts)",
    "pairs": "preference pairs (DPO)",
    "chat": "conversations (SFT)",
    "mix": "a mixture of sources (data.mix)",
    "plain": "plain token shards (pretraining)",
}
_VERBS = {
    "rl": "loom rl",
    "pairs": "loom dpo",
    "chat": "loom sft",
    "mix": "loom train",
    "plain": "loom train",
}


def saved_data_kind(loader_state: dict) -> str:
    """The kind of data a checkpoint's loader position ("loader" of its state.json) was written by, read from
    the keys each loader saves (RL's rollouts, the chat and pair loaders' "kind", a mixture's "mix"), so
    checkpoints written before this check are read too."""
    if "rollouts" in loader_state:
        return "rl"
    if loader_state.get("kind") in ("pairs", "chat"):
        return loader_state["kind"]
    return "mix" if "mix" in loader_state else "plain"


def requested_data_kind(cfg: Config, saved: str) -> str | None:
    """The kind of data `cfg` would train on: the stage loom.train.stage.build_stage would choose (its STAGES'
    order: RL, preference pairs, chat, pretraining), a mixture apart from one source. A mixture run given
    data.path (`saved` == "mix") trains on that path. None: the data cannot be read (its own checks say why)."""
    from loom.data.loader import read_meta
    from loom.train.stage import STAGES

    d = cfg.data
    switched = bool(d.mix and d.path and saved == "mix")  # data.path on a mixture run: the path's kind
    meta: dict = {}
    if d.path and (switched or not d.mix):
        try:
            meta = read_meta(d.path)
        except LoomError:
            return None
    stage = next(s for s in STAGES if s.applies(cfg, meta)).name
    if stage == "pretrain":
        return "mix" if d.mix and not switched else "plain"
    return {"rl": "rl", "dpo": "pairs", "sft": "chat"}[stage]


def _data_words(kind: str, data: dict, prompts: str) -> str:
    """How a config names the data of `kind` (data.path, data.sources and data.mix, rl.prompts) as options."""
    if kind == "rl":
        return f"--rl.prompts={prompts}"
    if kind == "mix":
        sources = data.get("sources") or ""
        return (f"--data.sources={sources} " if sources else "") + f"--data.mix={data.get('mix', '')}"
    return f"--data.path={data['path']}" if data.get("path") else "the built-in corpus (no data.path)"


def check_data_kind(cfg: Config, run_dir: Path, ckpt: Path) -> None:
    """A resumed run keeps the kind of data it trained on (DATA_KINDS): a DPO run given chat data would go on
    as SFT in the same folder (its metrics, its checkpoints, its reference log-probabilities dropped), a
    mixture run given data.path would read another stream. Refused, in every direction, before any step and
    before anything in the run folder changes (state.json's loader position and config only)."""
    state = checkpoint.read_state(ckpt)
    loader = state.get("loader")
    if not isinstance(loader, dict):
        return  # no loader position to continue: nothing the data could contradict
    was = saved_data_kind(loader)
    now = requested_data_kind(cfg, was)
    saved = state.get("config") or {}
    if now == was == "mix":
        check_same_mixture(cfg, saved.get("data") or {}, run_dir, ckpt, state["step"])
    if now is None or now == was:
        return
    before = _data_words(was, saved.get("data") or {}, (saved.get("rl") or {}).get("prompts", ""))
    d = cfg.data
    after = _data_words(now, {"path": d.path, "sources": d.sources, "mix": d.mix}, cfg.rl.prompts)
    start = after if after.startswith("--") else ""  # the built-in corpus is no option
    if was == "rl":
        after += " without rl.prompts"
    raise LoomError(
        f"run '{run_dir}' trained on {DATA_KINDS[was]} and this resume gives it {DATA_KINDS[now]} ({after}): "
        f"a resumed run keeps the kind of data it started with (its checkpoint '{ckpt.name}' holds a "
        f"{was} loader position)",
        hint=f"resume it with its own data ({before}), or start a new run from its weights: "
        f"{_VERBS[now]} --model.init_from=run:{run_dir} {start}".rstrip(),
    )


def check_same_mixture(cfg: Config, saved: dict, run_dir: Path, ckpt: Path, step: int) -> None:
    """A resumed mixture reads the rows of the mixture it started with: data.mix's sources and weights and
    data.mix_schedule's phases, as parsed, must be the saved config's (a folder may have moved: the paths are
    not compared; the loader compares each source's cursor and windows). A schedule changed after the
    checkpoint's step is refused too (docs/data.md): the run's config.toml names one schedule for all its steps,
    and it is left as it was."""
    from loom.data.mix import mix_weights, parse_mix

    def text(v) -> str:  # a TOML list of strings, as the config reads it
        return ",".join(v) if isinstance(v, list) else str(v or "")

    def phases(data: dict) -> tuple[list[str], list[tuple[int, list[float]]]]:
        sources, weights = parse_mix(text(data.get("mix")), text(data.get("sources")))
        steps = mix_weights(weights, str(data.get("mix_schedule") or ""), sources)
        return [x.name for x in sources], [(at, w.tolist()) for at, w in steps]

    d = cfg.data
    mine = phases({"mix": d.mix, "sources": d.sources, "mix_schedule": d.mix_schedule})
    try:
        before = phases(saved)
    except LoomError:
        return  # a saved mixture this loom cannot parse: the loader's own comparison decides
    if mine == before:
        return
    key = "data.mix" if mine[0] != before[0] or mine[1][0] != before[1][0] else "data.mix_schedule"
    was = saved.get("mix_schedule" if key == "data.mix_schedule" else "mix", "")
    now = d.mix_schedule if key == "data.mix_schedule" else d.mix
    changed = [at for at, w in mine[1] if (at, w) not in before[1]] + [
        at for at, w in before[1] if (at, w) not in mine[1]
    ]
    when = f" (from step {min(changed)})" if changed and key == "data.mix_schedule" else ""
    raise LoomError(
        f"run '{run_dir}' mixes its sources with {key}={repr(was) if was else '(none)'}; this resume gives "
        f"{key}={repr(now) if now else '(none)'}{when}: a resumed mixture keeps the mixture it started with, for all its steps "
        f"(checkpoint '{ckpt.name}' is at step {step})",
        hint=f"resume without --{key} (the run's config.toml keeps its own), or start a new run from its weights "
        f"with the new mixture: loom train --model.init_from=run:{run_dir} --{key}=...",
    )
