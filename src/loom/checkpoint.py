"""Checkpoints: one directory per step, written atomically, verified on load.

Layout of `<run>/ckpt/step_000500/`:
  model.pt      the model's state_dict (tensors only)
  optim.pt      the optimizer's state_dict
  extra.pt      RNG states and other tensors (loss scaler)
  state.json    step, loader position, resolved config, anything JSON
  manifest.json size and SHA-256 of every file above, written last

Everything is written into `step_000500.tmp/` and renamed when complete, so a crash never leaves a half
checkpoint under a final name. Loading uses `torch.load(weights_only=True)`: no pickle code runs.

That is format 1 (whole tensors, written by rank 0 until the sharded writer of issue 16 replaced it): still read,
no longer written. The trainer writes format 2 (`save_sharded`):
  model/        torch.distributed.checkpoint (DCP) folder: `__<rank>_0.distcp` per rank + `.metadata`
  optim/        the same for the optimizer state, keyed by parameter name
  extra.pt, state.json   as above, from rank 0
  manifest.json "format": 2; every file with its size and SHA-256, each hashed by the rank that wrote it
Each rank writes only the shards it holds; loading reshards them onto any layout (loom.parallel.dcp_state),
and a model-only load (`generate`, `eval`, `export`) reads model/ alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from loom import log
from loom.errors import LoomError

_STEP_RE = re.compile(r"^step_(\d{6,})$")
TENSOR_FILES = ("model.pt", "optim.pt", "extra.pt")


def step_dir(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:06d}"


def _sha256(path: Path, sync: bool = False) -> str:
    """The file's SHA-256; with sync, also flush it to the disk (a node crash then cannot lose it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def estimate_bytes(tensors: dict[str, Any], state: dict) -> int:
    """Bytes a checkpoint of these state dicts will take, from their real sizes: each tensor's payload plus
    the framing its file format adds per entry, the JSON, and a few KiB of per-file headers.

    The per-entry figures are measured upper bounds (torch 2.x): torch.distributed.checkpoint writes every
    tensor as its own torch.save record (~1.6 KiB of zip framing, 64-byte aligned) plus ~0.2 KiB and its name in
    .metadata; a non-tensor value (an lr, a step count) as a pickled record of ~1.3 KiB. No fixed slack per
    state dict: a small checkpoint on a small disk is judged by what it really needs."""

    def walk(obj, name: str = "") -> int:
        if isinstance(obj, torch.Tensor):
            obj = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's shard
            return obj.numel() * obj.element_size() + 2048 + 2 * len(name)
        if isinstance(obj, dict):
            return sum(walk(v, f"{name}.{k}") + 64 for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return sum(walk(v, f"{name}.{i}") for i, v in enumerate(obj)) + 64
        return 1536 + 2 * len(name) + len(repr(obj))

    return walk(tensors) + 2 * len(json.dumps(state)) + 8192


def _free_bytes(path: Path) -> int:
    while not path.exists():  # the checkpoint folder may not exist yet: ask its nearest existing parent
        path = path.parent
    return shutil.disk_usage(path).free


def check_free_space(ckpt_dir: str | Path, step: int, need: int, free: int | None = None) -> None:
    """Raise LoomError before writing when the disk cannot hold `need` bytes (free: a test's override)."""
    free = _free_bytes(Path(ckpt_dir)) if free is None else free
    if free < need:
        raise LoomError(
            f"not enough disk space for checkpoint step {step} in '{ckpt_dir}': needs about "
            f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free",
            hint="free some space, lower train.keep_last, or set run.dir on a larger disk",
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(step: int, final: Path, e: BaseException) -> LoomError:
    reason = getattr(e, "strerror", None) or str(e).splitlines()[0][:300]
    return LoomError(
        f"could not write checkpoint step {step} to '{final}': {reason}",
        hint="check free space and permissions of run.dir; earlier checkpoints are untouched",
    )


def _dcp_save(sd: dict, path: Path, no_dist: bool, group=None) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(sd, storage_writer=writer, no_dist=no_dist, process_group=group)
    except dcp.CheckpointException as e:  # a BaseException: raise what a rank met (a full disk: an OSError)
        failed = next(iter(e.failures.values()), None)
        if failed is None or not isinstance(failed[0], Exception):
            raise
        raise failed[0] from None


def _own_files(tmp: Path, rank: int, main: bool) -> dict:
    """Size and SHA-256 of the files this rank wrote (its shards; rank 0 also metadata, extra, state)."""
    mine = [p for sub in ("model", "optim") for p in sorted((tmp / sub).glob(f"__{rank}_*.distcp"))]
    if main:
        mine += [
            tmp / "model" / ".metadata",
            tmp / "optim" / ".metadata",
            tmp / "extra.pt",
            tmp / "state.json",
        ]
    return {
        str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p, sync=True)} for p in mine
    }


def save_sharded(
    ckpt_dir: str | Path,
    step: int,
    model_sd: dict,
    optim_sd: dict,
    extra: dict,
    state: dict,
    keep_last: int,
    control,
    free_bytes: int | None = None,
    after_first_file: Callable[[Path], None] | None = None,
    group=None,
) -> Path:
    """Write a format-2 checkpoint; called by every rank with its own pieces (loom.parallel.dcp_state).

    Each rank checks the free space for its shards, writes them into `step_N.tmp/` through DCP and hashes
    them; rank 0 gathers the per-rank manifests through the control plane, writes manifest.json and renames
    the folder into place: the step directory appears only when every rank's files are complete. Without a
    torch process group (one process, MPI: replicated state) rank 0 alone writes. Every rank raises the
    same way when any rank failed, so all of them stop or go on together. `group`: the process group of
    DCP's own collectives (a background save runs them on a group of its own, `control` over the same).
    """
    import torch.distributed as dist

    final = step_dir(ckpt_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    main, no_dist = control.rank == 0, not (dist.is_available() and dist.is_initialized())
    writes = main or not no_dist

    def stop_unless_every_rank_wrote(err: LoomError | None) -> None:
        failed = control.all_reduce_sum([float(err is not None)])[0] > 0
        if (err is not None or failed) and main:
            shutil.rmtree(tmp, ignore_errors=True)
        if err is not None:
            raise err
        if failed:
            raise LoomError(f"another rank could not write its part of checkpoint step {step}; not saved")

    need = estimate_bytes({"model": model_sd, "optim": optim_sd}, {}) if writes else 0
    need += estimate_bytes(extra, state) if main else 0
    stop_unless_every_rank_wrote(_make_room(ckpt_dir, step, tmp, final, need, free_bytes, main))
    err = None
    try:
        files = {}
        if writes:
            _dcp_save(model_sd, tmp / "model", no_dist, group)
            if main and after_first_file is not None:
                after_first_file(tmp)
            _dcp_save(optim_sd, tmp / "optim", no_dist, group)
            files = _own_parts(tmp, extra, state, 0 if no_dist else control.rank, main)
    except Exception as e:  # OSError, or what DCP met on a rank (_dcp_save unwraps its CheckpointException)
        from loom.distributed.health import is_comm_error

        # a peer died or hangs inside DCP's collectives: the ranks cannot agree on anything now. Raised at once,
        # so this rank ends and its peers' waits on it fail; an agreement all-reduce here met a peer still in
        # DCP's broadcast, and the two waited on each other for parallel.timeout_s (issue 59's chaos run)
        if is_comm_error(e):
            raise
        err, files = _write_error(step, final, e), {}
    stop_unless_every_rank_wrote(err)
    parts = control.gather_object(files)
    stop_unless_every_rank_wrote(_publish_step(tmp, final, step, parts) if main else None)
    if main:
        _tidy(ckpt_dir, keep_last)
    return final


def _tidy(ckpt_dir, keep_last: int) -> None:
    """Step folders left by a process killed while writing removed; old steps pruned to keep_last."""
    for stale in Path(ckpt_dir).glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    prune(ckpt_dir, keep_last)


def _make_room(ckpt_dir, step: int, tmp: Path, final: Path, need: int, free_bytes, main: bool):
    """None when this rank's `need` bytes fit and (rank 0) an empty step_N.tmp is ready, else the error."""
    try:
        check_free_space(ckpt_dir, step, need, free_bytes)
        if main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
    except LoomError as e:
        return e
    except OSError as e:
        return _write_error(step, final, e)
    return None


def _own_parts(tmp: Path, extra: dict, state: dict, rank: int, main: bool) -> dict:
    """Rank 0's extra.pt and state.json written; this rank's files hashed for the manifest."""
    if main:
        torch.save(extra, tmp / "extra.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")
    return _own_files(tmp, rank, main)


def _publish_step(tmp: Path, final: Path, step: int, parts: list[dict]) -> LoomError | None:
    """Rank 0: the manifest of every rank's files, everything synced, then step_N.tmp renamed into place;
    the error when the disk refused."""
    try:
        _manifest_then_rename(tmp, final, step, parts)
    except OSError as e:
        return _write_error(step, final, e)
    return None


def _manifest_then_rename(tmp: Path, final: Path, step: int, parts: list[dict]) -> None:
    merged = {k: v for part in parts for k, v in part.items()}
    (tmp / "manifest.json").write_text(
        json.dumps({"step": step, "format": 2, "files": dict(sorted(merged.items()))}, indent=1),
        encoding="utf-8",
    )
    _sha256(tmp / "manifest.json", sync=True)
    for sub in ("model", "optim", "."):
        _fsync_dir(tmp / sub)
    if final.exists():  # the same step saved again (e.g. the final step after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def list_steps(ckpt_dir: str | Path) -> list[Path]:
    """Checkpoint directories under ckpt_dir, oldest first (temporary ones excluded)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def prune(ckpt_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints. Only checkpoints count and only they are deleted: a
    folder named like one that is not (no manifest, files missing or of the wrong size: a copy, a stray
    folder, a damaged save) neither takes a place among the kept ones nor is removed; it is named once.
    The check reads the manifest and file sizes only (no hashing), so it costs little at every save; a
    checkpoint this process hashed and found corrupt (a resume that fell back past it) counts as damaged too,
    else it took a place and the valid older one it fell back to was deleted."""
    valid = []
    for p in list_steps(ckpt_dir):
        try:
            verify(p, share=None)
            if _corrupt.get(p.resolve()) == _signature(p):  # sizes right, but hashed and found corrupt
                raise LoomError(f"checkpoint '{p}' failed its SHA-256 check (corrupt)")
            valid.append(p)
        except LoomError as e:
            log.warn_once(f"{e.message}: train.keep_last does not count it, and it is left in place")
    for p in valid[:-keep_last] if keep_last > 0 else []:
        if pins(p):  # the base of a LoRA run, which holds no copy of it
            users = ", ".join(f.read_text(encoding="utf-8").strip() or f.name for f in pins(p))
            log.warn_once(
                f"checkpoint '{p}' is kept beyond train.keep_last: the LoRA run(s) {users} were trained on it "
                f"(delete {p.name}{PIN_SUFFIX}* beside it to let it go)"
            )
            continue
        shutil.rmtree(p, ignore_errors=True)


PIN_SUFFIX = ".pin."  # step_N.pin.<run_id>: a file beside a checkpoint that a fine-tuned run depends on


def pin(path: Path, run_id: str, user: Path) -> None:
    """Mark checkpoint `path` as the base of the run `user` (its run_id names the mark): its own run's
    train.keep_last then keeps it (prune). A file beside the checkpoint, not in it (the manifest lists
    exactly its files); the base run's folder not writable is a warning, not an error."""
    try:
        (path.parent / f"{path.name}{PIN_SUFFIX}{run_id}").write_text(f"{user}\n", encoding="utf-8")
    except OSError as e:
        log.warn(f"could not mark '{path}' as this run's base ({e}): its run's train.keep_last may delete it")


def pins(path: Path) -> list[Path]:
    """The marks of the runs that depend on checkpoint `path` (pin)."""
    return sorted(path.parent.glob(f"{path.name}{PIN_SUFFIX}*"))


REQUIRED_FILES = (*TENSOR_FILES, "state.json")
SHARDED_REQUIRED = ("extra.pt", "state.json", "model/.metadata", "optim/.metadata")
_SHARD_RE = re.compile(r"^(model|optim)/(\.metadata|__\d+_\d+\.distcp)$")
# Checkpoints verified in this process, by their files' (name, size, mtime): a resume that first looks for
# the newest valid checkpoint and then loads it hashes the files once, not twice.
_verified: dict[Path, tuple] = {}
# Checkpoints found corrupt in this process (a file that does not match the manifest), by the same signature:
# prune, which hashes nothing, must not keep one in place of a valid checkpoint.
_corrupt: dict[Path, tuple] = {}


def _signature(path: Path) -> tuple:
    return tuple(
        (str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    )


def is_sharded(path: str | Path) -> bool:
    """Whether a checkpoint folder is format 2 (DCP shards) rather than format 1 (model.pt, ...)."""
    return (Path(path) / "model").is_dir() or not (Path(path) / "model.pt").exists()


def _check_names(path: Path, records: dict) -> None:
    if any(n.startswith(("model/", "optim/")) for n in records):
        bad = [n for n in records if not (_SHARD_RE.match(n) or n in SHARDED_REQUIRED)]
        missing = [n for n in SHARDED_REQUIRED if n not in records]
        if bad or missing:
            raise LoomError(
                f"checkpoint '{path}' manifest lists {sorted(bad) or sorted(records)[:6]}, "
                f"expected {list(SHARDED_REQUIRED)} and model/, optim/ shards (corrupt)"
            )
    elif sorted(records) != sorted(REQUIRED_FILES):
        raise LoomError(
            f"checkpoint '{path}' manifest lists {sorted(records)}, expected {list(REQUIRED_FILES)} (corrupt)"
        )


def hash_owner(name: str, world: int) -> int:
    """The rank that checks a file's SHA-256 when `world` ranks verify a checkpoint together: shard
    `__k_0.distcp` goes to rank k mod world (on the layout that wrote it, the rank that wrote it and reads it
    back), every other file to rank 0."""
    m = re.search(r"__(\d+)_\d+\.distcp$", name)
    return int(m.group(1)) % world if m else 0


def verify(path: str | Path, model_only: bool = False, share: tuple[int, int] | None = (0, 1)) -> None:
    """Raise LoomError naming the problem if the checkpoint at `path` is missing, incomplete or corrupt.

    The manifest must list exactly loom's files by plain name (format 2: model/ and optim/ shard names; a
    manifest cannot point outside the folder); each file must have the recorded size and SHA-256. With
    `model_only`, a format-2 checkpoint's optim/ files are neither required nor read. `share` = (rank,
    world): this rank hashes only the files `hash_owner` gives it (every file is still checked for presence
    and size); None: no file is hashed (a cheap check before the ranks hash their shares together).
    """
    path = Path(path)
    manifest = path / "manifest.json"
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise LoomError(f"checkpoint '{path}' {what}", hint="give a checkpoint folder, RUN/ckpt/step_N")
    signature = _signature(path)
    if _verified.get(path.resolve()) == signature or _verified.get((path.resolve(), model_only)) == signature:
        return
    if not manifest.is_file():
        raise LoomError(f"checkpoint '{path}' has no manifest.json (incomplete or not a checkpoint)")
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        records = {str(k): (int(v["bytes"]), str(v["sha256"])) for k, v in files.items()}
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError, TypeError, ValueError, AttributeError):
        raise LoomError(f"checkpoint '{path}' has an unreadable manifest.json (corrupt)") from None
    _check_names(path, records)
    for name, (size, digest) in records.items():
        if model_only and name.startswith("optim/"):
            continue
        f = path / name
        if not f.is_file():
            raise LoomError(f"checkpoint '{path}' is missing {name}")
        if f.stat().st_size != size:
            raise LoomError(
                f"checkpoint file '{f}' has {f.stat().st_size} bytes, manifest says {size} (truncated or corrupt)"
            )
        if share is not None and hash_owner(name, share[1]) == share[0] and _sha256(f) != digest:
            _corrupt[path.resolve()] = signature
            raise LoomError(f"checkpoint file '{f}' does not match its SHA-256 in the manifest (corrupt)")
    if share == (0, 1):  # every file hashed
        _verified[(path.resolve(), True) if model_only else path.resolve()] = signature


def latest_valid(
    ckpt_dir: str | Path, model_only: bool = False, share: tuple[int, int] | None = (0, 1)
) -> Path | None:
    """The newest checkpoint that verifies (its weights alone with `model_only`; `share` as in verify);
    corrupt newer ones are reported and skipped."""
    for p in reversed(list_steps(ckpt_dir)):
        try:
            verify(p, model_only=model_only, share=share)
            return p
        except LoomError as e:
            log.warn(f"skipping checkpoint: {e}")
    return None


def share_errors(path: Path, control, model_only: bool = False) -> list[str | None] | None:
    """Every rank of `control` verifies `path`, hashing only its share of the files (hash_owner): None when
    all of them found it intact, else what each rank found (None where intact), on rank 0; [] on the others."""
    try:
        verify(path, model_only=model_only, share=(control.rank, control.size))
        error = None
    except LoomError as e:
        error = e.message
    if control.all_reduce_sum([float(error is not None)])[0] == 0:
        return None
    _corrupt[path.resolve()] = _signature(path)  # every rank: rank 0 prunes, whichever rank found it
    return control.gather_object(error) or []


def newest_intact(candidates: list[Path], control, model_only: bool = False) -> Path | None:
    """The newest of `candidates` (oldest first, as list_steps gives them) whose files every rank finds intact,
    each hashing its share: all ranks agree on it. Rank 0 names what the ranks found wrong with newer ones."""
    for path in reversed(candidates):
        errors = share_errors(path, control, model_only)
        if errors is None:
            return path
        for e in errors:
            if e:
                log.warn(f"skipping checkpoint: {e}")
    return None


def model_identity(path: str | Path) -> str:
    """SHA-256 that identifies a checkpoint's model weights: its manifest's records (name, size, SHA-256) of the
    model's files (a consolidated model.safetensors: the file's own hash). The same weights saved give the
    same files; a folder re-saved with other weights under the same name gives another value. verify()
    checks the files themselves against the manifest when they are read."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return _sha256(path)
    try:
        files = json.loads((path / "manifest.json").read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError):
        raise LoomError(
            f"checkpoint '{path}' has no readable manifest.json (incomplete or not a checkpoint)"
        ) from None
    model = {k: v for k, v in files.items() if k == "model.pt" or k.startswith("model/")}
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()


def read_state(path: str | Path) -> dict:
    """state.json of a checkpoint (step, loader position, config), without loading any tensor."""
    f = Path(path) / "state.json"
    try:
        state = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoomError(f"checkpoint file '{f}' is not readable JSON: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise LoomError(f"checkpoint file '{f}' has no step: not a loom checkpoint")
    return state


def load(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict]:
    """Verify and load a checkpoint: (tensors by name, state.json). No pickle code runs (weights_only)."""
    path = Path(path)
    if is_sharded(path):  # format 2: whole tensors read from the shards (optim: flat, by parameter name)
        from loom.parallel import dcp_state

        tensors, state = load_extra(path)
        for part in ("model", "optim"):
            tensors[part] = dcp_state.read_whole(path / part)
        return tensors, state
    verify(path)
    tensors = {}
    for name in TENSOR_FILES:
        try:
            tensors[name.removesuffix(".pt")] = torch.load(
                path / name, map_location=map_location, weights_only=True
            )
        except Exception as e:  # a file torch cannot read, or one holding objects weights_only refuses
            raise LoomError(f"checkpoint file '{path / name}' cannot be loaded: {e}") from None
    return tensors, read_state(path)


def load_extra(path: str | Path) -> tuple[dict[str, Any], dict]:
    """Of a format-2 checkpoint, after verifying it: ({'extra': RNG and scaler}, state.json); the model and
    optimizer shards are read by loom.parallel.dcp_state into each rank's own pieces."""
    path = Path(path)
    verify(path)
    try:
        extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise LoomError(f"checkpoint file '{path / 'extra.pt'}' cannot be loaded: {e}") from None
    return {"extra": extra}, read_state(path)


def load_model(path: str | Path, model: torch.nn.Module, verified: bool = False) -> None:
    """Load only the weights of a format-2 checkpoint into a model, single-device or sharded (generate, eval,
    export): model/ and state.json are verified (unless the caller has) and read, optim/ is not touched (it
    may even be missing)."""
    from loom.parallel import dcp_state

    path = Path(path)
    if not verified:
        verify(path, model_only=True)
    dcp_state.load_model_shards(model, path / "model", tied_names(model))


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{alias: canonical name} of every parameter the model holds under two names (a head tied to the token
    embedding: {'lm_head.weight': 'wte.weight'}), read off the model itself, whatever its family."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def names_step(resume: str | bool) -> bool:
    """Whether `--resume PATH` names one step folder (then no other checkpoint may stand in for it)."""
    return isinstance(resume, str) and bool(_STEP_RE.match(Path(resume).name))


def resolve_resume(run_dir: Path, resume: str | bool, share: tuple[int, int] | None = (0, 1)) -> Path:
    """`--resume` (True: newest valid in the run) or `--resume PATH` (a run dir or a step dir); `share` as
    in verify."""
    target = Path(resume) if isinstance(resume, str) else run_dir
    if names_step(resume) and target.is_dir():
        verify(target, share=share)
        return target
    ckpt_dir = target / "ckpt" if (target / "ckpt").is_dir() else target
    found = latest_valid(ckpt_dir, share=share)
    if found is None:
        partial = sorted(p.name for p in ckpt_dir.glob("step_*.tmp")) if ckpt_dir.is_dir() else []
        why = f" ({', '.join(partial)}: a save interrupted half way, discarded)" if partial else ""
        hint = "start without --resume, or point --resume at a run directory that has checkpoints"
        if (target / "config.toml").is_file():  # a run that never completed a checkpoint: nothing to resume
            hint = (
                "there is nothing to resume: start the run over with --force (replaces it), or with "
                "train.resume=auto (starts again a run that has no checkpoint)"
            )
        raise LoomError(f"--resume: no valid checkpoint under '{ckpt_dir}'{why}", hint=hint)
    return found


def resume_state(
    run_dir: Path, resume: str | bool, share: tuple[int, int] | None = (0, 1)
) -> tuple[Path, dict]:
    """The checkpoint `--resume` names (resolve_resume) and its state.json (read_state): what a run request
    asks of the checkpoint, answered in one call."""
    ckpt = resolve_resume(run_dir, resume, share)
    return ckpt, read_state(ckpt)
