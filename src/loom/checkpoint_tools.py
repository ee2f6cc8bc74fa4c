"""`loom ckpt`: what a checkpoint holds (inspect), one safetensors model made from its shards (consolidate), and
one made from several checkpoints' weights averaged, or from train.ema's average (average).

Consolidation streams: the safetensors header is written first from DCP's metadata (names, shapes, dtypes),
then each tensor is read whole from the shards of every rank that wrote a piece of it, appended, and freed,
so memory stays near the largest tensor whatever the model's size. The output folder is a small run
(config.toml, tokenizer/, model.safetensors) that `loom generate`, `loom eval` and `loom export` read.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import torch

from loom import checkpoint
from loom.errors import LoomError

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _steps(target: Path) -> list[Path]:
    if checkpoint._STEP_RE.match(target.name) and target.is_dir():
        return [target]
    ckpt_dir = target / "ckpt" if (target / "ckpt").is_dir() else target
    steps = checkpoint.list_steps(ckpt_dir)
    if not steps:
        raise LoomError(f"no checkpoint under '{target}'", hint="give a run directory or RUN/ckpt/step_N")
    return steps


def describe(path: Path) -> dict:
    """Format, step, layout, parts with file counts and bytes, and whether it verifies (and if not, why)."""
    info: dict = {"path": str(path), "format": 2 if checkpoint.is_sharded(path) else 1}
    try:
        checkpoint.verify(path)
        info["valid"] = True
    except LoomError as e:
        info["valid"], info["problem"] = False, e.message
    try:
        state = checkpoint.read_state(path)
        par = state.get("config", {}).get("parallel", {})
        info["step"], info["world_size"] = state["step"], state.get("world_size", 1)
        info["layout"] = {
            k: par.get(k) for k in ("dp_impl", "dp_replicate", "dp_shard", "tp", "pp") if k in par
        }
    except LoomError as e:
        info.setdefault("problem", e.message)
    parts: dict = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        part = f.relative_to(path).parts[0] if f.parent != path else f.name
        rec = parts.setdefault(part, {"files": 0, "bytes": 0})
        rec["files"] += 1
        rec["bytes"] += f.stat().st_size
    info["parts"] = parts
    return info


def inspect_main(target: str, as_json: bool = False) -> int:
    infos = [describe(p) for p in _steps(Path(target))]
    if as_json:
        print(json.dumps(infos, indent=1))
        return 0
    for i in infos:
        layout = " ".join(f"{k}={v}" for k, v in i.get("layout", {}).items())
        print(
            f"{i['path']}: step {i.get('step', '?')}, format {i['format']}, world size {i.get('world_size', '?')}"
            f" ({layout}), {'valid' if i['valid'] else 'INVALID: ' + i['problem']}"
        )
        for name, rec in i["parts"].items():
            print(f"  {name:<14} {rec['files']:>4} file(s) {rec['bytes'] / 2**20:>10.2f} MiB")
    return 0


def consolidate(run_dir: str | Path, out: str | Path, step: int | None = None, force: bool = False) -> Path:
    """Write out/model.safetensors (tensor by tensor), out/config.toml and out/tokenizer/ from a run's
    checkpoint (the newest valid one, or `step`); only the model's files are read."""
    run_dir, out = Path(run_dir), Path(out)
    if step is None:
        path = checkpoint.latest_valid(run_dir / "ckpt", model_only=True)
        if path is None:
            raise LoomError(f"run '{run_dir}' has no valid checkpoint")
    else:
        path = checkpoint.step_dir(run_dir / "ckpt", step)
        checkpoint.verify(path, model_only=True)
    if not checkpoint.is_sharded(path):
        raise LoomError(
            f"'{path}' is a format-1 checkpoint (model.pt): already whole",
            hint="use loom export RUN --format safetensors for it",
        )
    _check_run_config(run_dir, path)  # the folder's config.toml is the run's: it must describe these weights
    lora = checkpoint.read_state(path).get("config", {}).get("finetune", {}).get("lora_rank", 0)
    if lora:
        raise LoomError(
            f"'{path}' is a LoRA run's checkpoint (finetune.lora_rank={lora}): it holds what the run trains, "
            "not the frozen base it was trained on",
            hint=f"loom export {run_dir} --format safetensors writes the whole model, the adapters merged",
        )
    _check_out(run_dir, out, force)
    from loom.outputs import staged_output, write_marker

    with staged_output(out, "consolidated", force) as tmp:  # renamed into place when whole (a full disk)
        tmp.mkdir()
        write_marker(tmp, "consolidated")
        _write_consolidated(run_dir, path, tmp)
    return out / "model.safetensors"


def average(
    run_dir: str | Path, out: str | Path, last: int = 0, ema: bool = False, force: bool = False
) -> tuple[Path, list[int]]:
    """Write a consolidated folder (as `consolidate`: model.safetensors, config.toml, tokenizer/) whose
    weights are the uniform mean of the run's `last` newest valid checkpoints (checkpoint averaging, as
    OLMo-core's model merging and modded-nanogpt's), or, with `ema`, the newest checkpoint's moving average
    of the weights (train.ema). Each checkpoint is read whole in turn; the sum is kept in float64 and written
    in the weights' dtype. Returns (the file, the steps it averaged)."""
    run_dir, out = Path(run_dir), Path(out)
    if ema == bool(last):
        raise LoomError(
            "loom ckpt average takes --last N (N >= 1) or --ema", hint="e.g. loom ckpt average RUN --last 3"
        )
    paths = _checkpoints_to_average(run_dir, 1 if ema else last)
    _check_out(run_dir, out, force)
    from loom.outputs import staged_output, write_marker

    sd, dtypes = {}, {}
    for path in paths:
        for k, v in _weights(path, ema).items():
            dtypes.setdefault(k, v.dtype)
            sd[k] = sd[k] + v.double() if k in sd else v.double()
    steps = [int(checkpoint.read_state(p)["step"]) for p in paths]
    tensors = {k: (v / len(paths)).to(dtypes[k]).contiguous() for k, v in sorted(sd.items())}
    with staged_output(out, "consolidated", force) as tmp:  # renamed into place when whole
        tmp.mkdir()
        write_marker(tmp, "consolidated")
        _write_averaged(run_dir, paths[-1], tmp, tensors, steps, ema)
    return out / "model.safetensors", steps


def _checkpoints_to_average(run_dir: Path, n: int) -> list[Path]:
    """The n newest checkpoints of the run that verify (weights and, for the average, the config)."""
    found = []
    for p in reversed(checkpoint.list_steps(run_dir / "ckpt")):
        try:
            checkpoint.verify(p, model_only=True)
        except LoomError:
            continue
        found.append(p)
        if len(found) == n:
            break
    if len(found) < n:
        raise LoomError(
            f"run '{run_dir}' has {len(found)} valid checkpoint(s), {n} asked for",
            hint="average fewer (--last), or keep more while training (train.keep_last, train.ckpt_every)",
        )
    for p in found:
        if not checkpoint.is_sharded(p):
            raise LoomError(
                f"'{p}' is a format-1 checkpoint (model.pt), which loom ckpt average does not read"
            )
        _check_run_config(run_dir, p)
        lora = checkpoint.read_state(p).get("config", {}).get("finetune", {}).get("lora_rank", 0)
        if lora:
            raise LoomError(
                f"'{p}' is a LoRA run's checkpoint (finetune.lora_rank={lora}): it holds the adapters alone",
                hint=f"loom export {run_dir} --format safetensors writes the whole model, the adapters merged",
            )
    return found[::-1]


def _weights(path: Path, ema: bool) -> dict[str, torch.Tensor]:
    """A checkpoint's model weights, whole on the CPU (with `ema`: train.ema's average in their place)."""
    from loom.parallel.dcp_state import read_whole, saved_keys

    weights = read_whole(path / "model")
    if not ema:
        return weights
    keys = [k for k in saved_keys(path / "optim") if k.startswith("ema.")]
    if not keys:
        raise LoomError(
            f"checkpoint '{path}' holds no moving average of the weights (it was not trained with train.ema)",
            hint="train with --train.ema=0.999 (for example), or average checkpoints with --last N",
        )
    from loom.parallel.dcp_state import load_into

    avg = {
        k: torch.empty(weights[k[len("ema.") :]].shape, dtype=weights[k[len("ema.") :]].dtype) for k in keys
    }
    load_into(avg, path / "optim", "optimizer")
    weights.update({k[len("ema.") :]: v for k, v in avg.items()})
    return weights


def _write_averaged(
    run_dir: Path, newest: Path, out: Path, tensors: dict, steps: list[int], ema: bool
) -> None:
    """model.safetensors of the averaged weights (metadata: the newest step, the model config, what was
    averaged) and the run's config.toml, tokenizer/ and run.json, into `out`."""
    from safetensors.torch import save_file

    state = checkpoint.read_state(newest)
    meta = {
        "format": "pt",
        "loom_step": str(state["step"]),
        "loom_model": json.dumps(state.get("config", {}).get("model", {})),
        "loom_average": f"ema of step {steps[-1]}" if ema else "mean of steps " + ",".join(map(str, steps)),
    }
    save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    _copy_run_files(run_dir, out)


def _copy_run_files(run_dir: Path, out: Path) -> None:
    """The run's config.toml, tokenizer/ and run.json, which a consolidated folder carries."""
    shutil.copyfile(run_dir / "config.toml", out / "config.toml")
    if (run_dir / "tokenizer").is_dir():
        shutil.copytree(run_dir / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    if (run_dir / "run.json").is_file():
        shutil.copyfile(run_dir / "run.json", out / "run.json")


def _write_consolidated(run_dir: Path, path: Path, out: Path) -> None:
    """model.safetensors streamed from checkpoint `path`'s model/, and the run's config.toml, tokenizer/ and
    run.json, into the folder `out`."""
    from loom.parallel.dcp_state import SafeReader

    md = SafeReader(path / "model").read_metadata()
    metas = {k: v for k, v in sorted(md.state_dict_metadata.items()) if hasattr(v, "size")}
    header: dict = {}
    offset = 0
    for name, m in metas.items():
        n = m.size.numel() * m.properties.dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[m.properties.dtype],
            "shape": list(m.size),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    state = checkpoint.read_state(path)
    header["__metadata__"] = {
        "format": "pt",
        "loom_step": str(state["step"]),
        "loom_model": json.dumps(state.get("config", {}).get("model", {})),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    target = out / "model.safetensors"
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, m in metas.items():
            _write_tensor(f, path / "model", name, m, md.storage_data)
    _copy_run_files(run_dir, out)


def _check_run_config(run_dir: Path, path: Path) -> None:
    """The run's config.toml, which the consolidated folder takes, describes the model `path` trained."""
    from loom.config import check_saved_config, config_from_dict, load_toml

    if (run_dir / "config.toml").is_file():
        check_saved_config(
            checkpoint.read_state(path).get("config", {}),
            config_from_dict(load_toml(run_dir / "config.toml")),
            f"checkpoint '{path}'",
            f"'{run_dir / 'config.toml'}' must hold the model settings the checkpoint was trained "
            "with: put them back (the checkpoint records them in its state.json)",
            inference=True,
        )


def consolidated_model(file: Path) -> dict | None:
    """The model section of the config a consolidated model.safetensors was trained with (its metadata), or
    None for a file without one."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own types for damaged files
        raise LoomError(f"cannot read '{file}': {e}") from None
    return json.loads(meta["loom_model"]) if "loom_model" in meta else None


def check_fits(sd: dict, model: torch.nn.Module, source: str, hint: str | None = None) -> None:
    """Every tensor of `sd` has a parameter of the model's shape and every parameter a tensor (a tied head
    may be left out when its embedding is there): the last guard after config.check_model_config, for
    files that record no config."""
    mine, tied = model.state_dict(), checkpoint.tied_names(model)
    missing = sorted(k for k in mine if k not in sd and not (k in tied and tied[k] in sd))
    extra = sorted(k for k in sd if k not in mine)
    shapes = [
        f"{k}: {tuple(v.shape)} vs {tuple(mine[k].shape)}"
        for k, v in sd.items()
        if k in mine and v.shape != mine[k].shape
    ]
    if missing or extra or shapes:
        what = shapes[:3] or [
            f"{n} {', '.join(ks[:3])}" for n, ks in (("missing", missing), ("extra", extra)) if ks
        ]
        raise LoomError(f"{source} does not fit the model of its config.toml: " + "; ".join(what), hint=hint)


def _check_out(run_dir: Path, out: Path, force: bool) -> None:
    """The output folder: never the run read nor any other run (it would lose its config.toml, run.json and
    tokenizer/), and with --force replacing only a folder consolidate wrote (loom.outputs' rule)."""
    from loom.outputs import check_apart, check_replaceable, output_kind

    check_apart(out, [run_dir], inside_ok=True)
    if output_kind(out) == "run":
        raise LoomError(
            f"--out '{out}' is a training run: loom ckpt consolidate never writes into a run directory "
            "(it would replace that run's config.toml, run.json and tokenizer/)",
            hint=f"give a new folder for the consolidated model, e.g. --out {out}-consolidated",
        )
    check_replaceable(out, "consolidated", force)


def load_consolidated(folder: Path, model: torch.nn.Module) -> None:
    """Weights of a consolidated folder (model.safetensors, the tied head left out) into a model."""
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    check_fits(sd, model, f"'{folder / 'model.safetensors'}'")
    model.load_state_dict(sd, strict=False)


# Streaming tensor bytes out of DCP's files. DCP (TORCH_SAVE format) writes each chunk of a tensor as one
# torch.save archive (an uncompressed zip) at an offset of a rank's .distcp file; the raw bytes of the chunk
# are the zip member `*/data/<key>`, located through `*/data.pkl`, which a restricted unpickler reads without
# building a tensor. Chunks that are whole row blocks (FSDP's dim-0 shards, replicated tensors) are copied
# file to file in blocks of _BLOCK bytes, so memory stays constant; other splits (tensor parallel's columns)
# are assembled in one host tensor of the output's size, filled chunk by chunk.
_BLOCK = 8 << 20


class _Window(io.RawIOBase):
    """A read-only file view of bytes [start, start + length) of an open file (one DCP item)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


class _Rebuild(pickle.Unpickler):
    """Reads a torch.save data.pkl of one tensor into (storage key, storage offset, shape, stride)."""

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return lambda storage, off, size, stride, *_: (storage, off, tuple(size), tuple(stride))
        if module == "torch" and name.endswith("Storage"):
            return name
        if module == "collections" and name == "OrderedDict":
            return dict
        raise pickle.UnpicklingError(f"{module}.{name} is not expected in a checkpoint tensor")

    def persistent_load(self, pid):
        return pid[2]  # ('storage', storage type, key, location, numel)


def _chunk_reader(f, info, numel: int, itemsize: int, where: str):
    """A readable object positioned at the first byte of one chunk's raw data."""
    if info.transform_descriptors:
        raise LoomError(
            f"'{where}' stores transformed (e.g. compressed) chunks, which consolidate does not read"
        )
    win = _Window(f, info.offset, info.length)
    if info.length == numel * itemsize:  # DCP's raw (safetensors) serialization
        return win
    try:
        zf = zipfile.ZipFile(win)
        pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        key, off, size, stride = _Rebuild(io.BytesIO(zf.read(pkl))).load()
        contiguous = tuple(torch.empty(size, device="meta").stride())
        if torch.Size(size).numel() != numel or (numel > 1 and stride != contiguous):
            raise ValueError(f"chunk of shape {size} and stride {stride}, {numel} elements expected")
        data = zf.open(pkl[: -len("data.pkl")] + f"data/{key}")
        data.read(off * itemsize)
        return data
    except (zipfile.BadZipFile, StopIteration, KeyError, ValueError, pickle.UnpicklingError, EOFError) as e:
        raise LoomError(f"checkpoint file '{where}' holds a chunk that cannot be read: {e}") from None


def _write_tensor(out, folder: Path, name: str, meta, storage: dict) -> None:
    """Append tensor `name`'s bytes (row-major, whole) to `out`, reading each of its chunks once."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    size, itemsize = meta.size, meta.properties.dtype.itemsize
    chunks = sorted(meta.chunks, key=lambda c: tuple(c.offsets))
    if sum(c.sizes.numel() for c in chunks) != size.numel():
        raise LoomError(
            f"checkpoint '{folder}' does not cover tensor '{name}' (missing or overlapping chunks)"
        )
    rows = all(tuple(c.sizes[1:]) == tuple(size[1:]) for c in chunks)
    whole = None if rows or not size.numel() else torch.empty(size, dtype=meta.properties.dtype)
    for c in chunks:
        info = storage[MetadataIndex(name, c.offsets)]
        where = folder / info.relative_path
        with open(where, "rb") as f:
            src = _chunk_reader(f, info, c.sizes.numel(), itemsize, str(where))
            if whole is None:
                _copy(src, out, c.sizes.numel() * itemsize, str(where))
            else:
                piece = torch.empty(c.sizes, dtype=meta.properties.dtype)
                _copy(src, memoryview(piece.view(torch.uint8).numpy()).cast("B"), piece.nbytes, str(where))
                whole[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))] = piece
                del piece
    if whole is not None:
        out.write(whole.view(torch.uint8).numpy().data)


def _copy(src, dst, n: int, where: str) -> None:
    """n bytes from src to dst (a file, or a writable memoryview of exactly n bytes), _BLOCK at a time."""
    done = 0
    while done < n:
        block = src.read(min(_BLOCK, n - done))
        if not block:
            raise LoomError(f"checkpoint file '{where}' ends early (truncated?)")
        if isinstance(dst, memoryview):
            dst[done : done + len(block)] = block
        else:
            dst.write(block)
        done += len(block)
