"""Sharded checkpoint state through torch.distributed.checkpoint (DCP), under the single-device model's names.

Each rank hands DCP only what it holds (FSDP/TP DTensors stay local shards; DCP records their global offsets),
so saving never makes a tensor whole and loading reads into each rank's own pieces whatever layout wrote them:
a checkpoint of fsdp x 4 resumes under ddp, tp x dp, pp x dp, HSDP or one process. The keys are the
single-device names on every layout: wrappers' prefixes go (`canonical`), a tied alias is saved once under
its canonical name (with pipeline parallel the two copies live on two stages; DCP keeps one of the equal
chunks), and optimizer state is keyed by parameter name (DCP's state_dict API, flattened:
`state.<name>.<moment>`), not by torch's per-layout parameter index.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from loom import device as dev
from loom.errors import LoomError
from loom.parallel.init import canonical
from loom.parallel.tensor import plain

_OPTIONS = None


def _options():
    global _OPTIONS
    if _OPTIONS is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        _OPTIONS = StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)
    return _OPTIONS


def _partial(partial: bool):
    """The load options: strict, unless the checkpoint leaves the frozen parameters out."""
    if not partial:
        return _options()
    import dataclasses

    return dataclasses.replace(_options(), strict=False)


def _inner(opt):
    """The torch optimizer that holds this rank's state (ZeRO-1 keeps its local shard in .optim)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def _optim_key(key: str, aliases: dict[str, str]) -> str:
    """'state.<param name>.<what>' with the parameter's single-device name."""
    kind, rest = key.split(".", 1)
    name, what = rest.rsplit(".", 1)
    return f"{kind}.{canonical(name, aliases)}.{what}"


def _dedup(sd: dict, rename) -> dict:
    """Renamed, a tied tensor once, and each tensor plain (loom.parallel.tensor.plain: no float8 wrapper in a
    checkpoint; the same storage, so a load into it lands in the parameter)."""
    out: dict = {}
    for k, v in sd.items():
        out.setdefault(rename(k), plain(v) if isinstance(v, torch.Tensor) else v)
    return out


def frozen_names(model: nn.Module, aliases: dict[str, str]) -> set[str]:
    """Single-device names of the parameters that do not train (a LoRA run's base): its checkpoints leave them
    out (they are what model.init_from, or the seeded init, gave the run: loom.runs)."""
    return {canonical(n, aliases) for n, p in model.named_parameters() if not p.requires_grad}


def model_shards(model: nn.Module, aliases: dict[str, str]) -> dict:
    """{single-device name: this rank's piece} of every trained parameter and buffer: DTensors stay sharded,
    nothing is gathered; frozen parameters are left out (an adapter-only checkpoint of a LoRA run)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = _dedup(get_model_state_dict(model, options=_options()), lambda k: canonical(k, aliases))
    frozen = frozen_names(model, aliases)
    return {k: v for k, v in sd.items() if k not in frozen}


def optim_shards(model: nn.Module, opt, aliases: dict[str, str], prefix: str = "") -> dict:
    """This rank's optimizer state, flattened and keyed by single-device parameter name (after `prefix`: a
    DiLoCo replica's own state, loom.parallel.diloco)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, _inner(opt), options=_options())
    return _dedup(sd, lambda k: prefix + _optim_key(k, aliases))


class HostStager:
    """Copies state dicts into host memory that a background writer saves while training changes the
    originals; on a GPU the pinned buffers are made once and reused by every save (DCP's stager)."""

    def __init__(self, cuda: bool):
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        self.cuda = cuda
        self.stagers: dict[str, BlockingAsyncStager] = {}
        self._make = lambda: BlockingAsyncStager(cache_staged_state_dict=cuda)

    def stage(self, part: str, sd: dict) -> dict:
        """A host copy of `sd` (DTensors stay DTensors, with host-memory local pieces)."""
        staged = self.stagers.setdefault(part, self._make()).stage(sd)
        if self.cuda:
            dev.synchronize(torch.device("cuda"))
        return staged


class SafeReader:
    """A DCP FileSystemReader whose `.metadata` (a pickle) is read by an unpickler that admits only DCP's
    metadata classes and torch's sizes and dtypes: a tampered checkpoint cannot run code."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": None,
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "WindowsPath", "Path", "PurePosixPath"},
        "collections": {"OrderedDict"},
    }

    def __new__(cls, path: str | Path):
        from torch.distributed.checkpoint import FileSystemReader

        allowed = cls._ALLOWED

        class _Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                names = allowed.get(module, set())
                if module in allowed and (names is None or name in names):
                    return super().find_class(module, name)
                raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")

        class _Reader(FileSystemReader):
            def read_metadata(self, *args, **kwargs):
                f = Path(self.path) / ".metadata"
                try:
                    with open(f, "rb") as fh:
                        md = _Unpickler(fh).load()
                except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
                    raise LoomError(f"checkpoint file '{f}' cannot be read: {e}") from None
                if getattr(md, "storage_meta", None) is None:
                    from torch.distributed.checkpoint.metadata import StorageMeta

                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id
                return md

        return _Reader(str(path))


def saved_keys(path: str | Path) -> dict[str, tuple[int, ...] | None]:
    """{key: global shape (None for a non-tensor)} of a DCP folder, from its metadata only."""
    md = SafeReader(path).read_metadata()
    return {
        k: tuple(getattr(v, "size", ())) if hasattr(v, "size") else None
        for k, v in md.state_dict_metadata.items()
    }


def read_whole(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder, whole, on the CPU (one process; tools and tests, not training)."""
    md = SafeReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.items() if hasattr(v, "size")}
    load_into(sd, path)
    return sd


def _check_keys(path: Path, want: dict, what: str) -> None:
    have = saved_keys(path)
    missing = sorted(k for k in want if k not in have)
    shapes = [
        f"{k}: {have[k]} saved, {tuple(v.shape)} here"
        for k, v in want.items()
        if k in have and isinstance(v, torch.Tensor) and have[k] is not None and have[k] != tuple(v.shape)
    ]
    if missing or shapes:
        detail = "; ".join(shapes[:4] or [f"missing {', '.join(missing[:4])}"])
        settings = "optimizer settings (optim.name, ...)" if what == "optimizer" else f"{what} settings"
        raise LoomError(
            f"checkpoint '{path.parent}' does not fit this {what}: {detail}",
            hint=f"resume with the {settings} it was trained with (its state.json 'config'), or "
            "start a new run",
        )


def load_into(sd: dict, path: str | Path, what: str = "model") -> None:
    """Read a DCP folder into `sd`'s tensors in place (each rank only the pieces it holds)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    _check_keys(path, sd, what)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=SafeReader(path), no_dist=no_dist)
    except LoomError:
        raise
    except Exception as e:  # DCP wraps every rank's read errors into one CheckpointException
        raise LoomError(f"checkpoint '{path}' cannot be loaded: {str(e).splitlines()[0][:300]}") from None


def load_model_shards(model: nn.Module, path: str | Path, aliases: dict[str, str]) -> None:
    """Load a DCP model folder into this rank's pieces of `model`, whatever layout saved it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    local = get_model_state_dict(model, options=_options())
    target = _dedup(local, lambda k: canonical(k, aliases))
    saved = saved_keys(path)
    # a LoRA run's checkpoint holds what it trains: its frozen base stays as the model holds it already
    kept = {k for k in frozen_names(model, aliases) if k not in saved}
    target = {k: v for k, v in target.items() if k not in kept}
    load_into(target, path, "model")
    update = {k: target[canonical(k, aliases)] for k in local if canonical(k, aliases) in target}
    set_model_state_dict(model, update, options=_partial(bool(kept)))


def load_optim_shards(
    model: nn.Module, opt, path: str | Path, aliases: dict[str, str], prefix: str = ""
) -> None:
    """Load the optimizer's per-parameter state (moments, step) from a DCP folder; the hyperparameters of
    the param groups stay those of this run's config (and its implementation flags those of this layout).
    `prefix`: the keys of a DiLoCo replica's own state, when the checkpoint has them (a plain checkpoint's
    state serves every replica)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = _inner(opt)
    local = get_optimizer_state_dict(model, inner, options=_options())  # creates empty state if none yet
    states = {k: v for k, v in local.items() if k.startswith("state.")}
    if prefix and not any(k.startswith(prefix) for k in saved_keys(path)):
        prefix = ""
    target = _dedup(states, lambda k: prefix + _optim_key(k, aliases))
    load_into(target, path, "optimizer")
    loaded = {k: (target[prefix + _optim_key(k, aliases)] if k in states else v) for k, v in local.items()}
    set_optimizer_state_dict(model, inner, loaded, options=_options())
