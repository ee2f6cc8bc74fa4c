"""Validation loss over a fixed set of windows, and loading a trained run for eval/generate."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

import torch

from loom import checkpoint
from loom.config import Config, check_model_config, config_from_dict, load_toml
from loom.data.loader import ValSet, doc_eot_id, read_meta
from loom.data.tokenizers import has_tokenizer, load_tokenizer
from loom.errors import LoomError
from loom.eval.evaluator import EvalContext, Every
from loom.model.lora import apply_configured, merge_lora
from loom.model.registry import spec_of


@torch.no_grad()
def val_loss(
    model: torch.nn.Module,
    valset: ValSet,
    micro_batch_size: int,
    device: torch.device,
    autocast=contextlib.nullcontext,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> float:
    """Mean token loss over the validation set's trained targets (every target of pretraining text; the
    assistant's of chat data); with several ranks each holds a share and sums are reduced (a padding batch,
    whose targets are all -1, runs its forward and counts nothing: ValSet.batches)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in valset.batches(micro_batch_size):
        n = int((y != -1).sum())  # the targets that count (SFT: the assistant's), read on the host
        x, y = x.to(device), y.to(device)
        with autocast():
            loss = model(x, y)
        if not n:  # a padding batch: its loss is 0/0
            continue
        total[0] += loss.double() * n
        total[1] += n
    total = all_reduce_sum(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


class ValLossEval(Every):
    """Validation loss (and bits per byte when the data has a tokenizer) every train.eval_every steps."""

    name = "val_loss"

    def __init__(self, valset: ValSet, micro_batch_size: int, every: int):
        super().__init__(every)
        self.valset, self.micro_batch_size = valset, micro_batch_size
        self.last: float | None = None  # the newest validation loss (the run's summary reports it)
        self._tokens_per_byte: float | None = None  # the windows' bytes, counted at the first evaluation

    def run(self, ctx: EvalContext) -> dict:
        par = ctx.parallel
        if par.pipeline is not None:
            loss = par.pipeline.val_loss(self.valset, self.micro_batch_size, ctx.autocast, par.all_reduce_sum)
        else:
            with par.loss_context():
                loss = val_loss(
                    par.eval_model(),
                    self.valset,
                    self.micro_batch_size,
                    ctx.device,
                    ctx.autocast,
                    par.all_reduce_sum,
                )
        self.last = loss
        if ctx.tokenizer is None or getattr(self.valset, "tokens_per_byte", True) is False:
            return {"val_loss": loss}
        if self._tokens_per_byte is None:
            self._tokens_per_byte = tokens_per_byte(
                self.valset, ctx.tokenizer, ctx.device, par.all_reduce_sum
            )
        return {"val_loss": loss, "val_bpb": bits_per_byte(loss, self._tokens_per_byte)}

    def line(self, step: int, record: dict) -> str:
        bpb = f" | {record['val_bpb']:.4f} bits/byte" if record.get("val_bpb") else ""
        return f"step {step:>6} | val loss {record['val_loss']:.4f}{bpb}"


def tokens_per_byte(
    valset: ValSet,
    tokenizer,
    device: torch.device | str = "cpu",
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> float:
    """Target tokens per UTF-8 byte of the validation windows: each window's targets decoded to text and its
    bytes counted (a window cut inside a multi-byte character counts its replacement character; a few bytes
    in a set of thousands). A sum over the ranks' shares; a rank counted twice (tensor parallel holds the
    same windows on each tp rank) counts tokens and bytes alike, so the ratio holds."""
    tokens = n_bytes = 0
    for i in range(0, len(valset.ids), 64):
        for row in valset.windows.rows(valset.ids[i : i + 64])[:, 1:].tolist():
            tokens += len(row)
            n_bytes += len(tokenizer.decode(row).encode("utf-8"))
    total = all_reduce_sum(torch.tensor([tokens, n_bytes], dtype=torch.float64, device=device))
    return (total[0] / total[1]).item() if total[1] > 0 else math.nan


def bits_per_byte(loss: float, tokens_per_byte: float) -> float:
    """Validation loss in bits per byte of text: nats/token / ln 2 x tokens/byte. Independent of the
    tokenizer, so a char run and a BPE run on the same text compare (lower is better)."""
    return loss / math.log(2) * tokens_per_byte


def _open_run(run_dir: Path) -> tuple[Config, dict, object]:
    """(config, data meta, tokenizer or None) of a run directory."""
    if not (run_dir / "config.toml").is_file():
        raise LoomError(
            f"'{run_dir}' is not a loom run directory (no config.toml)", hint="give a runs/<name> folder"
        )
    cfg = config_from_dict(load_toml(run_dir / "config.toml"))
    meta = read_meta(run_dir / "tokenizer")
    tokenizer = load_tokenizer(run_dir / "tokenizer", meta) if has_tokenizer(meta) else None
    return cfg, meta, tokenizer


def _eot(run_dir: Path, cfg: Config, meta: dict) -> int | None:
    """The end-of-text id a data.doc_mask=true run's model finds its documents by (None when off)."""
    return doc_eot_id(run_dir / "tokenizer", meta, cfg.data.doc_mask)


def load_run(run_dir: str | Path, device: torch.device, ckpt: str | Path | None = None):
    """(config, model with the newest valid checkpoint's weights, tokenizer, data meta, checkpoint path)."""
    run_dir = Path(run_dir)
    cfg, meta, tokenizer = _open_run(run_dir)
    if not ckpt and _consolidated(run_dir):
        from loom.checkpoint_tools import load_consolidated

        check_trained_model(run_dir / "model.safetensors", cfg, run_dir)
        model = _build(cfg, meta, run_dir, "cpu")
        load_consolidated(run_dir, model)
        merge_lora(model)
        return cfg, model.to(device).eval(), tokenizer, meta, run_dir / "model.safetensors"
    path = Path(ckpt) if ckpt else checkpoint.latest_valid(run_dir / "ckpt", model_only=True)
    if path is None:
        raise LoomError(
            f"run '{run_dir}' has no valid checkpoint", hint="train it (checkpoints are written at the end)"
        )
    check_trained_model(path, cfg, run_dir)  # before the weights are read
    model = _build(cfg, meta, run_dir, "cpu").to(device)
    if checkpoint.is_sharded(path):  # model/ alone: the optimizer's files are never read
        checkpoint.load_model(path, model)
        merge_lora(model)
        model.eval()
        return cfg, model, tokenizer, meta, path
    from loom.checkpoint_tools import check_fits

    tensors, _ = checkpoint.load(path, map_location=device)
    check_fits(tensors["model"], model, f"checkpoint '{path}'", _hint(run_dir))
    model.load_state_dict(tensors["model"])
    merge_lora(model)
    model.eval()
    return cfg, model, tokenizer, meta, path


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
    from loom.distributed import process_group
    from loom.distributed.comm import TorchControl
    from loom.parallel import parallelize
    from loom.parallel.dims import ParallelDims

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
        checkpoint.load_model(path, par.model, verified=True)
    else:  # format 1: whole tensors on the host, each rank keeping its slices
        par.load_model_state(checkpoint.load(path, map_location="cpu")[0]["model"])
    par.model.eval()
    return cfg, par, tokenizer, meta, path


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

        saved = consolidated_model(path)
    else:
        saved = (
            checkpoint.read_state(path).get("config", {}).get("model")
            if (path / "state.json").is_file()
            else None
        )
    if saved is not None:
        check_model_config(saved, cfg, f"checkpoint '{path}'", _hint(run_dir), inference=True)


def run_data_dir(run_dir: str | Path, cfg: Config) -> Path:
    """The data directory a run was trained on (recorded in run.json)."""
    import json

    info = Path(run_dir) / "run.json"
    if info.is_file():
        return Path(json.loads(info.read_text(encoding="utf-8"))["data_dir"])
    if cfg.data.path:
        return Path(cfg.data.path)
    raise LoomError(f"cannot tell which data '{run_dir}' was trained on", hint="pass --data DIR")
