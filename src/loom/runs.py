"""Reading a run: its model with the newest checkpoint's weights (eval, generate, chat, export), and the weights a
run starts from when model.init_from names them: `hf:DIR` (a transformers directory, through the family's
mapping) or `run:DIR` (a loom run's checkpoint, itself read here: the two need each other). A LoRA run's
checkpoints hold only what it trains; its frozen base is what model.init_from gave it, which the run records
(pinned by name and identity: base_record) and every reader checks (check_base, check_same_run).

The data may extend a run's tokenizer (chat data adds its chat tokens after the run's ids: loom.data.chat): the
embedding (and an untied head) then grow by those rows, each new row the mean of the run's trained rows (a new
token starts as the average token, as nanochat and HF's resize_token_embeddings(mean_resizing) do), and every
existing id keeps its row.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn

from loom import checkpoint, log
from loom.config import Config, check_saved_config, config_from_dict, load_toml
from loom.data.loader import doc_eot_id, read_meta
from loom.data.tokenizers import has_tokenizer, load_tokenizer, run_tokenizer_dir
from loom.errors import LoomError
from loom.model.cpu_paths import inference_layout
from loom.model.lora import apply_configured, merge_lora
from loom.model.registry import spec_of

PREFIX = "run:"
# names of the vocabulary-sized weights of loom's families (rows = token ids)
_VOCAB_WEIGHTS = ("wte.weight", "lm_head.weight")
_ADAPTERS = (".lora_A", ".lora_B")


def _open_run(run_dir: Path) -> tuple[Config, dict, object]:
    """(config, data meta, tokenizer or None) of a run directory."""
    if not (run_dir / "config.toml").is_file():
        raise LoomError(
            f"'{run_dir}' is not a loom run directory (no config.toml)", hint="give a runs/<name> folder"
        )
    cfg = config_from_dict(load_toml(run_dir / "config.toml"))
    meta = read_meta(run_tokenizer_dir(run_dir))  # a missing tokenizer/ is named, not a bad data.path
    tokenizer = load_tokenizer(run_dir / "tokenizer", meta) if has_tokenizer(meta) else None
    return cfg, meta, tokenizer


def _eot(run_dir: Path, cfg: Config, meta: dict) -> int | None:
    """The end-of-text id a data.doc_mask=true run's model finds its documents by (None when off)."""
    return doc_eot_id(run_dir / "tokenizer", meta, cfg.data.doc_mask)


def load_run(run_dir: str | Path, device: torch.device, ckpt: str | Path | None = None, merge: bool = True):
    """(config, model with the newest valid checkpoint's weights, tokenizer, data meta, checkpoint path).
    A LoRA run's adapters are merged into the weights unless merge=False (the model keeps lora_A/lora_B)."""
    done = merge_lora if merge else (lambda model: model)
    run_dir = Path(run_dir)
    cfg, meta, tokenizer = _open_run(run_dir)
    if not ckpt and _consolidated(run_dir):
        from loom.checkpoint_tools import load_consolidated

        check_trained_model(run_dir / "model.safetensors", cfg, run_dir)
        model = _build(cfg, meta, run_dir, "cpu")
        load_consolidated(run_dir, model)
        done(model)
        return cfg, model.to(device).eval(), tokenizer, meta, run_dir / "model.safetensors"
    if ckpt:
        check_same_run(Path(ckpt), run_dir)
    path = Path(ckpt) if ckpt else checkpoint.latest_valid(run_dir / "ckpt", model_only=True)
    if path is None:
        raise LoomError(
            f"run '{run_dir}' has no valid checkpoint", hint="train it (checkpoints are written at the end)"
        )
    check_trained_model(path, cfg, run_dir)  # before the weights are read
    model = _build(cfg, meta, run_dir, "cpu").to(device)
    if checkpoint.is_sharded(path):  # model/ alone: the optimizer's files are never read
        checkpoint.verify(path, model_only=True)
        base = frozen_base(cfg, model, path)
        if base is not None:  # a LoRA run's checkpoint holds what it trained: the frozen base first
            model.load_state_dict(base, strict=False)
        checkpoint.load_model(path, model, verified=True)
        done(model)
        model.eval()
        return cfg, model, tokenizer, meta, path
    from loom.checkpoint_tools import check_fits

    tensors, _ = checkpoint.load(path, map_location=device)
    check_fits(tensors["model"], model, f"checkpoint '{path}'", _hint(run_dir))
    model.load_state_dict(tensors["model"])
    done(model)
    model.eval()
    return cfg, model, tokenizer, meta, path


def frozen_base(cfg: Config, model: nn.Module, path: Path) -> dict | None:
    """The weights a LoRA run's checkpoint leaves out (loom.parallel.dcp_state.model_shards keeps what trains):
    its frozen base, whole, by loom's names, as the run started with it: model.init_from's weights, or the
    seeded init of a run that had none; a QLoRA run's (finetune.quantize_base=nf4) base linears rounded through
    NF4, the values it trained against, as plain tensors (so its adapters merge into ordinary weights). None
    when the checkpoint holds every parameter."""
    from loom.parallel.dcp_state import saved_keys

    if all(
        p.requires_grad for p in model.parameters()
    ):  # nothing frozen (no LoRA): the checkpoint has it all
        return None
    saved = set(saved_keys(path / "model"))
    missing = [n for n, p in model.named_parameters() if not p.requires_grad and n not in saved]
    if not missing:
        return None
    check_base(checkpoint.read_state(path).get("base"), cfg, f"checkpoint '{path}'")
    state = pretrained_state(cfg, model)
    if state is None:  # no init_from: the values materialize gave each tensor (seeded by its name)
        state = {}
        for name, t in model.state_dict().items():
            if not name.endswith(_ADAPTERS):
                state[name] = torch.empty(t.shape, dtype=t.dtype)
                model.init_param(name, state[name], cfg.run.seed)
    if cfg.finetune.quantize_base == "nf4":
        from loom.model.nf4 import nf4_round_trip_state

        state = nf4_round_trip_state(model, state)
    return state


def _build(cfg: Config, meta: dict, run_dir: Path, device) -> torch.nn.Module:
    """The run's model, empty, with the LoRA adapters its checkpoints hold (finetune.lora_rank): loaded, then
    merged into the weights (loom.model.lora.merge_lora), so what reads it sees the base model's names."""
    model = spec_of(cfg).build_model(cfg, meta["vocab_size"], device, _eot(run_dir, cfg, meta))
    apply_configured(model, cfg.finetune)
    return model


def _consolidated(run_dir: Path) -> bool:
    """A `loom ckpt consolidate` folder: one model.safetensors, no checkpoints."""
    return not (run_dir / "ckpt").is_dir() and (run_dir / "model.safetensors").is_file()


def load_run_sharded(run_dir: str | Path, device: torch.device, env):
    """load_run for a model that need not fit one device: in a job of several processes (torchrun, srun,
    mpiexec), the model is built on the meta device and FSDP-sharded over every process; each rank reads only
    its pieces of the newest checkpoint's model/ (the optimizer's files are never read) and hashes only its
    share of them, the ranks agreeing on the newest checkpoint that verifies. Joins the job's process group.
    Returns (config, Parallelized, tokenizer, data meta, checkpoint path): every rank must run the same forward
    passes (`Parallelized.all_reduce_sum` sums over the ranks)."""
    from loom.config.layout import ParallelDims
    from loom.distributed import process_group
    from loom.distributed.comm import TorchControl
    from loom.parallel import parallelize

    run_dir = Path(run_dir)
    cfg, meta, tokenizer = _open_run(run_dir)
    if device.type == "cpu":
        from loom.env import cpu_memory_release

        cpu_memory_release()  # the all-gathered block buffers go back to the system, not into the heap
    process_group.init(env, device, cfg.parallel.timeout_s)
    if _consolidated(run_dir):
        path = run_dir / "model.safetensors"
    else:
        path = checkpoint.newest_intact(
            checkpoint.list_steps(run_dir / "ckpt"), TorchControl(), model_only=True
        )
        if path is None:
            raise LoomError(
                f"run '{run_dir}' has no valid checkpoint",
                hint="train it (checkpoints are written at the end)",
            )
    check_trained_model(path, cfg, run_dir)
    cfg.train.compile, cfg.train.activation_checkpointing = False, "none"
    cfg.precision.fp8 = "off"  # evaluation computes in high precision (loom.parallel.fp8)
    spec = spec_of(cfg)
    model = spec.build_model(cfg, meta["vocab_size"], "meta", _eot(run_dir, cfg, meta))
    apply_configured(
        model, cfg.finetune
    )  # the checkpoint's adapters (kept apart: a sharded model is not merged)
    dims = ParallelDims(1, env.world_size, 1, 1, env.world_size, env.rank, "fsdp")
    # no init: every value comes from the checkpoint
    par = parallelize(model, dims, cfg, device, spec)
    if path.suffix == ".safetensors":  # a consolidated file: read whole on the host, each rank its slices
        from loom.checkpoint_tools import load_consolidated

        whole = spec.build_model(cfg, meta["vocab_size"], "cpu", _eot(run_dir, cfg, meta))
        load_consolidated(run_dir, whole)
        par.load_model_state(whole.state_dict())
    elif checkpoint.is_sharded(path):
        base = frozen_base(cfg, model, path)
        if base is not None:  # a LoRA run's checkpoint holds its adapters: the frozen base first
            par.load_model_state(base)
        checkpoint.load_model(path, par.model, verified=True)
    else:  # format 1: whole tensors on the host, each rank keeping its slices
        par.load_model_state(checkpoint.load(path, map_location="cpu")[0]["model"])
    par.model.eval()
    return cfg, par, tokenizer, meta, path


def check_tp_run(run_dir: str | Path, tp: int) -> None:
    """A run that tensor parallel over tp processes can serve (`loom serve --nproc`): a loom run with a
    tokenizer, whose query and key/value heads tp divides. Read from its config alone, before any weight."""
    cfg, _, tokenizer = _open_run(Path(run_dir))
    if tokenizer is None:
        raise LoomError(
            f"run '{run_dir}' was trained on data without a tokenizer: cannot turn text into ids",
            hint="prepare the data with loom (or give nanogpt's meta.pkl) to get a tokenizer",
        )
    from loom.config import check_tp_heads

    try:
        check_tp_heads(cfg.model.n_head, cfg.model.n_kv_head or cfg.model.n_head, tp)
    except LoomError as e:  # said in serving's words: the processes are the tp degree
        raise LoomError(f"cannot split '{run_dir}' over {tp} processes: {e.message}", hint=e.hint) from None


def load_run_tp(run_dir: str | Path, device: torch.device, env, ckpt: str | Path | None = None):
    """load_run for tensor parallel over every process of a job (torchrun, `loom serve --nproc`): the model built
    on the meta device and split by the family's tp plan at tp = the world size, then each rank reading only its
    slices of a sharded checkpoint (DCP, as load_run_sharded; the ranks hash a share of model/ each). A
    consolidated file, a format-1 checkpoint or a LoRA run (adapters to merge) is read whole on every rank
    (load_run) and each rank keeps its slices. Joins the job's process group (left by the caller). Whatever layout the
    run trained under (tp, pp, fsdp), its checkpoint is resharded on this read. Sequence parallel is off: it
    changes where activations live, not the weights, and decoding one token has no sequence to split.
    Returns (config, model, tokenizer, data meta, checkpoint path); every rank runs the same forwards."""
    from loom.config.layout import ParallelDims
    from loom.distributed import process_group
    from loom.parallel import parallelize

    run_dir = Path(run_dir)
    check_tp_run(run_dir, env.world_size)
    cfg, meta, tokenizer = _open_run(run_dir)
    process_group.init(env, device, cfg.parallel.timeout_s)
    cfg.train.compile, cfg.train.activation_checkpointing = False, "none"
    cfg.precision.fp8, cfg.parallel.sp = "off", False
    spec = spec_of(cfg)
    model = spec.build_model(cfg, meta["vocab_size"], "meta", _eot(run_dir, cfg, meta))
    dims = ParallelDims(1, 1, env.world_size, 1, env.world_size, env.rank, "none")
    par = parallelize(model, dims, cfg, device, spec)  # the plan's own checks (the padded vocabulary) first
    path = _sharded_step(run_dir, cfg, ckpt)
    if path is not None:  # each rank reads its slices of the checkpoint's model/ (DCP), nothing else
        checkpoint.load_model(path, par.model, verified=True)
    else:
        _, whole, tokenizer, meta, path = load_run(run_dir, torch.device("cpu"), ckpt)  # adapters merged
        par.load_model_state(whole.state_dict())
        del whole
    par.model.eval()
    return cfg, par.model, tokenizer, meta, path


def _sharded_step(run_dir: Path, cfg: Config, ckpt) -> Path | None:
    """The checkpoint a tp job reads as DCP shards, each rank hashing its share of model/ and the ranks agreeing
    on it (the newest that verifies, or `ckpt`); None where the whole model must be read on every rank (a
    consolidated file, a format-1 checkpoint, a LoRA run's adapters to merge), or the run has none (load_run
    then says so)."""
    from loom.distributed.comm import TorchControl

    if _consolidated(run_dir) or cfg.finetune.lora_rank:
        return None
    if ckpt:
        check_same_run(Path(ckpt), run_dir)
    steps = [Path(ckpt)] if ckpt else checkpoint.list_steps(run_dir / "ckpt")
    if not steps or not all(checkpoint.is_sharded(p) for p in steps):
        return None
    path = checkpoint.newest_intact(steps, TorchControl(), model_only=True)
    if path is not None:
        check_trained_model(path, cfg, run_dir)
    return path


@dataclass
class LoadedRun:
    """A trained run's model for eval, generate and chat: whole on one device, whole on every rank of a job
    (`split`), or FSDP-sharded over the job's processes (`shard`)."""

    model: object
    tok: object
    cfg: Config
    path: Path
    device: torch.device
    rank: int
    world: int
    all_reduce_sum: object  # a sum over the ranks (sharded, or split over a job: a collective)


@contextlib.contextmanager
def open_run(run_dir, device, env, *, ckpt=None, shard: bool = False, split: bool = False):
    """run_dir's model (`LoadedRun`) on `device`; with `shard`, FSDP-sharded over the processes of a
    torchrun/srun/mpiexec job (each reading its part of the checkpoint). `split`: in a job of several
    processes without `shard`, each holds the whole model and the caller splits the work by the ranks (they sum
    through a process group); else every process does it all alone. A process group made here is left at the
    end; the job itself is the caller's to leave (world > 1)."""
    if not shard:
        cfg, model, tok, _, path = load_run(run_dir, device, ckpt)
        inference_layout(model)  # the model only runs forwards here: a CPU's faster weight layout
        if not split or env.world_size == 1:
            yield LoadedRun(model, tok, cfg, path, device, 0, 1, lambda t: t)
            return
        yield from _whole_on_every_rank(
            LoadedRun(model, tok, cfg, path, device, env.rank, env.world_size, None), env
        )
        return
    if env.world_size == 1:
        raise LoomError(
            "--shard splits the model over the processes of a job, and this is one process",
            hint="start it with torchrun --nproc-per-node N -m loom ... --shard (or srun / mpiexec)",
        )
    from loom.distributed import process_group

    log.setup(rank=env.rank, stderr=True)  # rank 0 tells; stdout keeps only the result
    clean = False
    try:
        cfg, par, tok, _, path = load_run_sharded(run_dir, device, env)
        yield LoadedRun(par.model, tok, cfg, path, device, env.rank, env.world_size, par.all_reduce_sum)
        clean = True
    finally:
        process_group.shutdown(clean)


def _whole_on_every_rank(run: LoadedRun, env):
    """`run` (the whole model) on each rank of the job, with a gloo/NCCL group to sum the ranks' shares: a
    torchrun `loom eval RUN` without --shard did the whole evaluation on every rank and printed it as often."""
    import torch.distributed as dist

    from loom.distributed import process_group

    log.setup(rank=env.rank)
    process_group.init(env, run.device, 600.0)
    clean = False
    try:
        yield replace(run, all_reduce_sum=lambda t: (dist.all_reduce(t), t)[1])
        clean = True  # shutdown's barrier: every rank has its sums before any leaves
    finally:
        process_group.shutdown(clean)


def _hint(run_dir: Path) -> str:
    return (
        f"'{run_dir / 'config.toml'}' must hold the model settings the checkpoint was trained with: put "
        "them back (the checkpoint records them in its state.json), or give a checkpoint of this run "
        "(--ckpt RUN/ckpt/step_N)"
    )


def check_trained_model(path: Path, cfg: Config, run_dir: Path) -> None:
    """eval, generate and export build the model from the run's config.toml: the checkpoint's own record of
    the model it trained (state.json; a consolidated file's metadata) must agree on every key that changes
    shapes or numerics (config.check_model_config), or a truncated or otherwise different model would be
    evaluated or exported without a word. A file with no record is left to the tensors' shape check."""
    if path.suffix == ".safetensors":
        from loom.checkpoint_tools import consolidated_model

        saved = {"model": consolidated_model(path)}
    else:
        saved = checkpoint.read_state(path).get("config") if (path / "state.json").is_file() else None
    if saved and saved.get("model") is not None:
        check_saved_config(saved, cfg, f"checkpoint '{path}'", _hint(run_dir), inference=True)


def run_data_dir(run_dir: str | Path, cfg: Config) -> Path:
    """The data directory a run was trained on (recorded in run.json)."""
    import json

    info = Path(run_dir) / "run.json"
    if info.is_file():
        return Path(json.loads(info.read_text(encoding="utf-8"))["data_dir"])
    if cfg.data.path:
        return Path(cfg.data.path)
    raise LoomError(f"cannot tell which data '{run_dir}' was trained on", hint="pass --data DIR")


# ----------------------------------------------------------------------------- model.init_from


def is_run_init(cfg: Config) -> bool:
    return cfg.model.init_from.startswith(PREFIX)


def init_source(cfg: Config) -> tuple[Path, Path | None]:
    """model.init_from=run:DIR or run:DIR/ckpt/step_N: (the run directory, the checkpoint named; None: the
    run's newest, which a run starting pins: pin_init_from)."""
    p = Path(cfg.model.init_from[len(PREFIX) :]).expanduser()
    if (p / "config.toml").is_file():
        return p, None
    if p.parent.name == "ckpt" and (p.parent.parent / "config.toml").is_file():
        return p.parent.parent, p
    raise LoomError(
        f"model.init_from={cfg.model.init_from}: '{p}' is neither a loom run directory (no config.toml) nor a "
        "checkpoint of one",
        hint="give run:runs/<name> (its newest checkpoint) or run:runs/<name>/ckpt/step_N",
    )


def run_dir_of(cfg: Config) -> Path:
    return init_source(cfg)[0]


# ----------------------------------------------------------------------------- what a fine-tuned run came from


def base_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint model.init_from=run:... names, which must still be there (None: the run's newest)."""
    _, ckpt = init_source(cfg)
    if ckpt is not None and not ckpt.is_dir():
        raise LoomError(
            f"model.init_from={cfg.model.init_from}: the checkpoint this run was fine-tuned from is gone (its run "
            "keeps the checkpoint a LoRA run marked, step_N.pin.*: deleted by hand, or before the mark existed)",
            hint="restore that checkpoint folder: a LoRA run's adapters were trained on those weights and hold "
            "no base of their own",
        )
    return ckpt


def pin_init_from(cfg: Config) -> None:
    """A run starting from run:DIR is pinned to DIR's newest valid checkpoint: model.init_from names that
    checkpoint from then on (config.toml, every checkpoint's config), so the base run training on, or saving
    newer checkpoints, changes nothing in this run, its evaluation, chat, export or resume."""
    if not is_run_init(cfg):
        return
    d, ckpt = init_source(cfg)
    if ckpt is not None or _consolidated(d):  # named already, or one model.safetensors that never moves on
        return
    path = checkpoint.latest_valid(d / "ckpt", model_only=True)
    if path is None:
        raise LoomError(
            f"model.init_from={cfg.model.init_from}: run '{d}' has no valid checkpoint", hint="train it"
        )
    cfg.model.init_from = f"{PREFIX}{path}"
    log.info(f"model.init_from: {d}'s newest checkpoint, {path.name} (pinned: the run's config names it)")


def pin_base(cfg: Config, run_dir: Path, run_id: str) -> None:
    """A LoRA run keeps no copy of its base: the base checkpoint is marked so that its run, training on, keeps
    it past train.keep_last (checkpoint.pin). A full fine-tuning holds every weight and needs no mark."""
    if is_run_init(cfg) and cfg.finetune.lora_rank and (ckpt := init_source(cfg)[1]) is not None:
        checkpoint.pin(ckpt, run_id, run_dir.resolve())


def base_record(cfg: Config) -> dict | None:
    """What a fine-tuned run records of the weights it started from (run.json and every checkpoint's
    state.json, "base"): model.init_from and the identity of its weights (checkpoint.model_identity,
    hf_io.fingerprint). None without model.init_from."""
    if not cfg.model.init_from:
        return None
    if is_run_init(cfg):
        d, _ = init_source(cfg)
        ident = checkpoint.model_identity(base_checkpoint(cfg) or d / "model.safetensors")
    else:
        from loom.model.hf_io import fingerprint, parse_init_from

        ident = fingerprint(parse_init_from(cfg.model.init_from))
    return {"init_from": cfg.model.init_from, "sha256": ident}


def check_base(saved: dict | None, cfg: Config, source: str) -> None:
    """A checkpoint that holds no base of its own (LoRA) was trained on the base it recorded (`saved`): the
    weights model.init_from gives now must be those, or its adapters would be applied to others. A checkpoint
    older than the record (None) is not checked."""
    if not saved:
        return
    now = base_record(cfg)
    if now == saved:
        return
    given = f"{now['init_from']} (sha256 {now['sha256'][:12]})" if now else "no model.init_from"
    raise LoomError(
        f"{source} was trained on the base {saved['init_from']} (sha256 {saved['sha256'][:12]}), but the run "
        f"now gives {given}: its adapters would be applied to other weights",
        hint="restore the base it was trained on (that checkpoint or transformers folder, unchanged) and the "
        "run's model.init_from, or fine-tune again from the new base",
    )


def origin(cfg: Config, ckpt: Path | None, run_dir: Path) -> dict:
    """What a run records of itself in run.json and every checkpoint's state.json: its run_id and the base it
    was fine-tuned from (base_record). New when it starts; a resumed run keeps its checkpoint's, once a LoRA
    run's base is checked to be the one its adapters were trained on."""
    import uuid

    if ckpt is None:
        return {"run_id": uuid.uuid4().hex, "base": base_record(cfg)}
    state = checkpoint.read_state(ckpt)
    if cfg.finetune.lora_rank:
        check_base(state.get("base"), cfg, f"checkpoint '{ckpt}'")
    return {"run_id": state.get("run_id") or run_id(run_dir) or uuid.uuid4().hex, "base": state.get("base")}


def same_base(saved: str, given: str) -> bool:
    """model.init_from given again on a resume (the command that started the run, run:DIR) for the pinned value
    the run saved (run:DIR/ckpt/step_N): the same base."""
    if saved == given or not (saved.startswith(PREFIX) and given.startswith(PREFIX)):
        return saved == given
    s, g = (Path(v[len(PREFIX) :]).expanduser() for v in (saved, given))
    return (
        s.parent.name == "ckpt" and (g / "config.toml").is_file() and s.parent.parent.resolve() == g.resolve()
    )


def run_id(run_dir: Path) -> str | None:
    """The identity of a run (run.json's run_id, kept by its resumes and copies), None for a run older than it."""
    import json

    info = Path(run_dir) / "run.json"
    if not info.is_file():
        return None
    return json.loads(info.read_text(encoding="utf-8")).get("run_id")


def check_same_run(path: Path, run_dir: Path) -> None:
    """--ckpt must name a checkpoint of this run: another run's, of the same shapes, would be evaluated, chatted
    with or exported under this run's name, tokenizer and template. Told by the run_id both record; a run or a
    checkpoint older than it, by the checkpoint lying in the run's ckpt/ folder."""
    if not (path / "state.json").is_file():  # not a checkpoint folder: the loaders say what it is
        return
    theirs, ours = checkpoint.read_state(path).get("run_id"), run_id(run_dir)
    inside = path.resolve().parent == (run_dir / "ckpt").resolve()
    if (theirs and ours and theirs == ours) or (not (theirs and ours) and inside):
        return
    raise LoomError(
        f"checkpoint '{path}' is not a checkpoint of the run '{run_dir}'"
        + (" (another run_id)" if theirs and ours else ""),
        hint=f"give one of '{run_dir / 'ckpt'}', or name its own run instead of '{run_dir}'",
    )


def pretrained_state(cfg: Config, model: nn.Module) -> dict | None:
    """model.init_from=hf:DIR or run:DIR: the whole imported weights by loom's names, on the host (to
    fine-tune)."""
    if not cfg.model.init_from:
        return None
    if is_run_init(cfg):  # run:DIR: a loom run's newest weights (its vocabulary grown for chat tokens)
        return run_init_state(cfg, model)
    import dataclasses

    from loom.model.hf_io import read_config_json

    spec = spec_of(cfg)
    if spec.hf is None:
        raise LoomError(
            f"model.init_from={cfg.model.init_from}: the family '{spec.name}' has no HF mapping",
            hint="leave model.init_from empty, or choose a family that imports from transformers",
        )
    d = spec.hf.parse_init_from(cfg.model.init_from)
    hf_vocab = read_config_json(d).get("vocab_size", model.cfg.vocab_size)  # fewer rows: chat tokens grow it
    host = spec.build(dataclasses.replace(model.cfg, vocab_size=min(hf_vocab, model.cfg.vocab_size)))
    spec.hf.load_hf_into(host, d)
    return _vocab_grown(host.state_dict(), cfg, model, hf_vocab)[0]


def grow_rows(old: torch.Tensor, new_shape: torch.Size, old_vocab: int, new_vocab: int) -> torch.Tensor:
    """A vocabulary-sized weight (rows = ids) of `new_shape`: the old rows for the old ids, the mean of those
    for ids old_vocab .. new_vocab - 1, and the old padding rows (or zeros) above: the head masks those ids."""
    out = torch.zeros(new_shape, dtype=old.dtype)
    out[:old_vocab] = old[:old_vocab]
    out[old_vocab:new_vocab] = old[:old_vocab].mean(dim=0)
    keep = min(len(old), len(out))
    if keep > new_vocab:
        out[new_vocab:keep] = old[new_vocab:keep]
    return out


def _vocab_grown(state: dict, cfg: Config, model: nn.Module, old_vocab: int) -> tuple[dict, dict]:
    """(state with its embedding and head grown from old_vocab ids to the model's, the whole model's state on
    the meta device): the chat tokens' new rows start as the mean row (the same rows when nothing was added)."""
    with torch.device("meta"):  # the whole model's names and shapes (a pipeline stage holds only its blocks)
        want = spec_of(cfg).build(model.cfg).state_dict()
    for name in _VOCAB_WEIGHTS:
        if name in state and name in want:
            state[name] = grow_rows(state[name], want[name].shape, old_vocab, model.cfg.vocab_size)
    if cfg.model.tie_embeddings and "lm_head.weight" in state:
        state["lm_head.weight"] = state["wte.weight"]
    return state, want


def run_init_state(cfg: Config, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint model.init_from names (pinned when the run started: pin_init_from) by
    loom's names for `model` (built for this run's vocabulary; whole, or this rank's pipeline stages), on the
    host: the whole model's."""
    d = run_dir_of(cfg)
    run_cfg, old, _, run_meta, path = load_run(d, torch.device("cpu"), base_checkpoint(cfg))
    state, want = _vocab_grown(
        {k: v.detach() for k, v in old.state_dict().items()}, cfg, model, run_meta["vocab_size"]
    )
    want = {k: v for k, v in want.items() if not k.endswith(_ADAPTERS)}  # adapters keep their init
    mismatched = [k for k in want if k in state and state[k].shape != want[k].shape]
    if mismatched or set(state) != set(want):
        raise LoomError(
            f"the weights of '{path}' do not fit this model: "
            + ", ".join(f"{k} {tuple(state[k].shape)} vs {tuple(want[k].shape)}" for k in mismatched[:3])
            + (f" (keys differ: {sorted(set(state) ^ set(want))[:4]})" if set(state) != set(want) else ""),
            hint="keep the run's model.* keys (block_size with learned positions cannot grow)",
        )
    return state
