"""`loom ckpt`: what a checkpoint holds (inspect) and one safetensors model made from its shards (consolidate).

Consolidation streams: the safetensors header is written first from DCP's metadata (names, shapes, dtypes),
then each tensor is read whole from the shards of every rank that wrote a piece of it, appended, and freed,
so memory stays near the largest tensor whatever the model's size. The output folder is a small run
(config.toml, tokenizer/, model.safetensors) that `loom generate`, `loom eval` and `loom export` read.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

from loom import checkpoint
from loom.errors import LoomError

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}  # fmt: skip


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
        print(f"{i['path']}: step {i.get('step', '?')}, format {i['format']}, world size {i.get('world_size', '?')}"
              f" ({layout}), {'valid' if i['valid'] else 'INVALID: ' + i['problem']}")  # fmt: skip
        for name, rec in i["parts"].items():
            print(f"  {name:<14} {rec['files']:>4} file(s) {rec['bytes'] / 2**20:>10.2f} MiB")
    return 0


def _tensor_meta(model_dir: Path) -> dict:
    from loom.parallel.dcp_state import SafeReader

    md = SafeReader(model_dir).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype) for k, v in sorted(md.items()) if hasattr(v, "size")}


def consolidate(run_dir: str | Path, out: str | Path, step: int | None = None, force: bool = False) -> Path:
    """Write out/model.safetensors (tensor by tensor), out/config.toml and out/tokenizer/ from a run's
    checkpoint (the newest valid one, or `step`); only the model's files are read."""
    from loom.parallel.dcp_state import load_into

    run_dir, out = Path(run_dir), Path(out)
    if step is None:
        path = checkpoint.latest_valid(run_dir / "ckpt", model_only=True)
        if path is None:
            raise LoomError(f"run '{run_dir}' has no valid checkpoint")
    else:
        path = checkpoint.step_dir(run_dir / "ckpt", step)
        checkpoint.verify(path, model_only=True)
    if not checkpoint.is_sharded(path):
        raise LoomError(f"'{path}' is a format-1 checkpoint (model.pt): already whole",
                        hint="use loom export RUN --format safetensors for it")  # fmt: skip
    if out.exists() and any(out.iterdir()) and not force:
        raise LoomError(f"--out '{out}' exists and is not empty", hint="give a new folder, or --force")
    out.mkdir(parents=True, exist_ok=True)
    metas = _tensor_meta(path / "model")
    header: dict = {}
    offset = 0
    for name, (shape, dtype) in metas.items():
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    state = checkpoint.read_state(path)
    header["__metadata__"] = {"format": "pt", "loom_step": str(state["step"]),
                              "loom_model": json.dumps(state.get("config", {}).get("model", {}))}  # fmt: skip
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    target = out / "model.safetensors"
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, (shape, dtype) in metas.items():
            t = {name: torch.empty(shape, dtype=dtype)}
            load_into(t, path / "model")
            if t[name].numel():
                f.write(t[name].contiguous().view(torch.uint8).numpy().data)  # no copy of the tensor
            del t
    shutil.copyfile(run_dir / "config.toml", out / "config.toml")
    if (run_dir / "tokenizer").is_dir():
        shutil.copytree(run_dir / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    if (run_dir / "run.json").is_file():
        shutil.copyfile(run_dir / "run.json", out / "run.json")
    return target


def load_consolidated(folder: Path, model: torch.nn.Module) -> None:
    """Weights of a consolidated folder (model.safetensors, the tied head left out) into a GPT."""
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    mine = model.state_dict()
    missing = sorted(k for k in mine if k not in sd and not _tied(k, sd))
    shapes = [f"{k}: {tuple(v.shape)} vs {tuple(mine[k].shape)}" for k, v in sd.items()
              if k in mine and v.shape != mine[k].shape]  # fmt: skip
    if missing or shapes:
        raise LoomError(f"'{folder / 'model.safetensors'}' does not fit the model of its config.toml: "
                        + "; ".join(shapes[:3] or [f"missing {', '.join(missing[:3])}"]))  # fmt: skip
    model.load_state_dict(sd, strict=False)


def _tied(name: str, sd: dict) -> bool:
    from loom.model.gpt_parallel import TIED

    return name in TIED and TIED[name] in sd
