"""The training loop: one process's view; data parallelism comes in through a `DataParallel` value."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from loom import __version__, checkpoint, log
from loom.config import Config, Derived, to_toml
from loom.data.loader import ShardLoader, ValSet, read_meta
from loom.data.tokenizers import copy_tokenizer, load_tokenizer
from loom.errors import LoomError
from loom.eval.val_loss import model_config, val_loss
from loom.generate import generate
from loom.metrics import JsonlSink, Throughput, format_step, peak_flops, peak_memory_bytes
from loom.model.flops import flops_per_token
from loom.model.gpt import GPT
from loom.optim.schedule import lr_at
from loom.parallel.base import DataParallel, model_state_bytes

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(cfg: Config, vocab_size: int, device: torch.device) -> GPT:
    """The single-device GPT for cfg.model, initialised from run.seed (identical on every rank)."""
    gcfg = model_config(cfg, vocab_size)
    if gcfg.vocab_size < vocab_size:
        raise LoomError(
            f"model.vocab_size={gcfg.vocab_size} is smaller than the data's vocabulary {vocab_size}"
        )
    torch.manual_seed(cfg.run.seed)
    return GPT(gcfg).to(device)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        derived: Derived,
        run_dir: Path,
        data_dir: Path,
        device: torch.device,
        dp: DataParallel | None = None,
    ):
        self.cfg, self.derived, self.run_dir, self.device = cfg, derived, run_dir, device
        self.dp = dp or DataParallel()
        self.main = self.dp.rank == 0
        self.meta = read_meta(data_dir)
        self.data_dir = data_dir
        t = cfg.train
        # Data first: a block_size the data cannot provide fails here, before the model is built.
        self.loader = ShardLoader(
            data_dir, t.batch_size, cfg.model.block_size, cfg.run.seed, self.dp.rank, self.dp.size
        )
        self.valset = ValSet(
            data_dir, cfg.model.block_size, t.eval_batches * t.batch_size, self.dp.rank, self.dp.size
        )
        self.tokenizer = load_tokenizer(data_dir, self.meta) if self.meta.get("tokenizer") else None
        self.raw_model = build_model(cfg, self.meta["vocab_size"], device)
        self.dp.broadcast_model(self.raw_model)
        self.model = self.dp.wrap(self.raw_model)
        if t.compile:
            self.model = torch.compile(self.model)
        self.optimizer = self.dp.build_optimizer(self.raw_model, cfg.optim, device)
        dtype = cfg.precision.dtype
        self.autocast_dtype = AUTOCAST.get(dtype)
        if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise LoomError("precision.dtype=bf16 but this GPU has no bf16", hint="use precision.dtype=fp16")
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == "fp16")
        self.step = 0
        self._first_step = True
        self.throughput = Throughput(
            flops_per_token(self.raw_model.cfg), peak_flops(device, dtype), self.dp.size, t.warmup_log_steps
        )
        self.metrics: JsonlSink | None = None  # opened with the run files, once nothing can fail cheaply

    # ---------------------------------------------------------------- state
    def state(self) -> tuple[dict, dict]:
        extra = {"rng_cpu": torch.get_rng_state(), "scaler": self.scaler.state_dict()}
        if self.device.type == "cuda":
            extra["rng_cuda"] = torch.cuda.get_rng_state(self.device)
        tensors = {
            "model": self.dp.model_state(self.raw_model),
            "optim": self.dp.optim_state(self.raw_model, self.optimizer),
            "extra": extra,
        }
        state = {
            "step": self.step,
            "loader": self.loader.state_dict(),
            "config": self.cfg.to_dict(),
            "world_size": self.dp.size,
            "loom_version": __version__,
        }
        return tensors, state

    def save(self) -> None:
        tensors, state = self.state()
        if self.main:
            path = checkpoint.save(self.run_dir / "ckpt", self.step, tensors, state, self.cfg.train.keep_last)
            log.info(f"saved checkpoint {path}")

    def load(self, path: Path) -> None:
        tensors, state = checkpoint.load(path, map_location=self.device)
        saved_model = state["config"]["model"]
        now = self.cfg.to_dict()["model"]
        diff = [
            f"model.{k}: {saved_model.get(k)!r} -> {v!r}" for k, v in now.items() if saved_model.get(k) != v
        ]
        if diff:
            raise LoomError(f"checkpoint '{path}' was trained with another model shape: " + "; ".join(diff))
        self.dp.load_model_state(self.raw_model, tensors["model"])
        self.dp.broadcast_model(self.raw_model)
        self.dp.load_optim_state(self.raw_model, self.optimizer, tensors["optim"])
        self.scaler.load_state_dict(tensors["extra"]["scaler"])
        torch.set_rng_state(tensors["extra"]["rng_cpu"])
        if self.device.type == "cuda" and "rng_cuda" in tensors["extra"]:
            torch.cuda.set_rng_state(tensors["extra"]["rng_cuda"], self.device)
        self.loader.load_state_dict(state["loader"])
        self.step = int(state["step"])
        log.info(
            f"resumed from {path} at step {self.step} (saved with world size {state.get('world_size', 1)})"
        )

    # ---------------------------------------------------------------- steps
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self) -> dict:
        """One optimizer step over the global batch: accumulate micro-batches, clip, step."""
        cfg, accum = self.cfg, self.derived.grad_accum
        lr = lr_at(self.step, cfg.optim.lr, cfg.optim.min_lr, cfg.optim.warmup_steps, cfg.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        x, y = self.loader.next_batch()
        xs, ys = x.to(self.device).chunk(accum), y.to(self.device).chunk(accum)
        loss_sum, dtf, dtb = torch.zeros((), device=self.device), 0.0, 0.0
        for i in range(accum):
            last = i == accum - 1
            with self.dp.no_sync(self.model, skip=not last):
                ta = time.perf_counter()
                with self._autocast():
                    loss = self.model(xs[i], ys[i]) / accum  # mean over the global batch's tokens
                self._sync()
                tb = time.perf_counter()
                self.scaler.scale(loss).backward()
                self._sync()
                dtf, dtb = dtf + tb - ta, dtb + time.perf_counter() - tb
            loss_sum += loss.detach()
        self.dp.after_backward()
        self.scaler.unscale_(self.optimizer)
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):  # DTensor parameters (FSDP): the norm is a DTensor too
            grad_norm = grad_norm.full_tensor()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step += 1
        mem = self._model_state_report()  # before zero_grad: gradients are part of what a step holds
        self.optimizer.zero_grad(set_to_none=True)
        loss_mean = self.dp.all_reduce_sum(loss_sum) / self.dp.size
        self._sync()
        dt = time.perf_counter() - t0
        rec = {"step": self.step, "loss": loss_mean.item(), "lr": lr, "grad_norm": grad_norm.item(), "dt": dt}
        rec.update(dtf=dtf, dtb=dtb, **self.throughput.step(self.derived.tokens_per_step, dt))
        rec["tokens"] = self.step * self.derived.tokens_per_step
        rec.update(mem)
        return rec

    def _model_state_report(self) -> dict:
        """mem_params/grads/optim: bytes this rank holds (its shards), on the first and every logged step."""
        if not (self._first_step or self._due(self.cfg.train.log_every) or self.step == self.cfg.train.steps):
            return {}
        m = model_state_bytes(self.raw_model, self.optimizer)
        if self._first_step:
            self._first_step = False
            log.info(f"rank {self.dp.rank} model state: params {m['params'] / 2**20:.1f} MiB, grads "
                     f"{m['grads'] / 2**20:.1f} MiB, optimizer {m['optim'] / 2**20:.1f} MiB (this rank's share)")  # fmt: skip
        return {f"mem_{k}": v for k, v in m.items()}

    def evaluate(self) -> float:
        return val_loss(
            self.raw_model, self.valset, self.derived.micro_batch_size, self.device, self._autocast,
            self.dp.all_reduce_sum,
        )  # fmt: skip

    def sample(self, prompt: str = "", max_new_tokens: int | None = None) -> str:
        """Text from the model, with a generator of its own so training's RNG stream is untouched."""
        ids = self.tokenizer.encode(prompt) if prompt else [self.tokenizer.eot_id]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.cfg.run.seed + self.step)
        with self._autocast():
            out = generate(
                self.raw_model,
                idx,
                max_new_tokens or self.cfg.train.sample_tokens,
                temperature=0.8,
                top_k=200,
                generator=g,
                vocab_size=self.tokenizer.vocab_size,
            )
        return self.tokenizer.decode(out[0, len(ids) :].tolist())

    # ---------------------------------------------------------------- the run
    def write_run_files(self) -> None:
        if not self.main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = JsonlSink(self.run_dir / "metrics.jsonl")
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg), encoding="utf-8")
        copy_tokenizer(self.data_dir, self.meta, self.run_dir / "tokenizer")
        info = {
            "loom_version": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": sys.argv,
            "device": str(self.device),
            "world_size": self.dp.size,
            "data_dir": str(self.data_dir),
            "params": self.raw_model.num_params(),
            "flops_per_token": self.throughput.flops_per_token,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (self.run_dir / "run.json").write_text(json.dumps(info, indent=1), encoding="utf-8")

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def train(self) -> dict:
        t = self.cfg.train
        self.write_run_files()
        log.info(
            f"model {self.raw_model.num_params() / 1e6:.2f}M params | device {self.device} | dp {self.dp.size}"
            f" | grad accum {self.derived.grad_accum} | {self.derived.tokens_per_step:,} tokens/step"
            f" | {t.steps} steps | run {self.run_dir}"
        )
        last_val = None
        while self.step < t.steps:
            rec = self.train_step()
            if not math.isfinite(rec["loss"]):
                raise LoomError(f"loss became {rec['loss']} at step {self.step}", hint="lower optim.lr")
            final = self.step == t.steps
            if self._due(t.log_every) or final:
                rec["mem_bytes"] = peak_memory_bytes(self.device)
                log.info(format_step(rec))
                if self.metrics:
                    self.metrics.write(rec)
            if self._due(t.eval_every) or final:
                last_val = self.evaluate()
                log.info(f"step {self.step:>6} | val loss {last_val:.4f}", style="bold")
                if self.metrics:
                    self.metrics.write({"step": self.step, "tokens": rec["tokens"], "val_loss": last_val})
            if (self._due(t.sample_every) or final) and (self.main or self.dp.sharded) and self.tokenizer:
                text = self.sample()  # with FSDP every rank runs the forward passes; rank 0 keeps the text
                if self.main:
                    log.info(f"--- sample at step {self.step} ---\n{text}\n---")
                    with open(self.run_dir / "samples.txt", "a", encoding="utf-8") as f:
                        f.write(f"=== step {self.step}\n{text}\n")
            if self._due(t.ckpt_every) or final:
                self.save()
        summary = {"step": self.step, "val_loss": last_val, **self.throughput.summary()}
        if self.main and summary.get("tokens_per_s"):
            mfu = summary.get("mfu")
            log.info(
                f"done: {summary['tokens_per_s']:,.0f} tokens/s"
                + (f", MFU {100 * mfu:.2f}%" if mfu is not None else ", MFU n/a")
                + (f", val loss {last_val:.4f}" if last_val is not None else "")
            )
        if self.metrics:
            self.metrics.write({"summary": summary})
            self.metrics.close()
        return summary
