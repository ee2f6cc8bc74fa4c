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

from loom import __version__, checkpoint, faults, log
from loom.config import Config, Derived, to_toml
from loom.data.loader import ShardLoader, ValSet, read_meta
from loom.data.tokenizers import copy_tokenizer, load_tokenizer
from loom.errors import LoomError
from loom.eval.val_loss import model_config, val_loss
from loom.generate import generate
from loom.metrics import Sinks, Throughput, format_step, open_sinks, peak_flops, peak_memory_bytes
from loom.model.flops import flops_per_token
from loom.model.gpt import GPT
from loom.optim.schedule import lr_at
from loom.outputs import write_marker
from loom.parallel.ac import apply_activation_checkpointing
from loom.parallel.base import DataParallel, model_state_bytes
from loom.train.guard import StepGuard, StopRequest, grad_flags, nonfinite_names
from loom.train.setup import cpu_memory_reuse, resolve_precision

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(cfg: Config, vocab_size: int, device: torch.device) -> GPT:
    """The single-device GPT for cfg.model, initialised from run.seed (identical on every rank)."""
    gcfg = model_config(cfg, vocab_size)
    if gcfg.vocab_size < vocab_size:
        raise LoomError(
            f"model.vocab_size={gcfg.vocab_size} is smaller than the data's vocabulary {vocab_size}"
        )
    torch.manual_seed(cfg.run.seed)
    model = GPT(gcfg)
    if cfg.model.init_from:  # e.g. hf:DIR, GPT-2 weights to fine-tune (a resumed checkpoint overrides them)
        from loom.model.hf import load_gpt2_into, parse_init_from

        load_gpt2_into(model, parse_init_from(cfg.model.init_from))
    return model.to(device)


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
        self.main = self.dp.is_main
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
        self.n_params = self.raw_model.num_params()  # before wrap: pipeline parallel keeps only its stages
        # The order of loom.parallel: activation checkpointing, then compile, then data parallel (the
        # compiled DDP module is what torch documents: its DDPOptimizer splits graphs at bucket boundaries).
        apply_activation_checkpointing(self.raw_model, t.activation_checkpointing)
        self.model = self.dp.wrap(self.raw_model)
        if t.compile:
            self.model = torch.compile(self.model)
        self.optimizer = self.dp.build_optimizer(self.raw_model, cfg.optim, device)
        dtype = self.precision = resolve_precision(
            cfg.precision.dtype, device, loss_scaling=cfg.parallel.pp == 1
        )
        if cfg.precision.dtype == "auto":
            log.info(f"precision.dtype=auto: {dtype} on {device}")
        self.autocast_dtype = AUTOCAST.get(dtype)
        if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise LoomError("precision.dtype=bf16 but this GPU has no bf16", hint="use precision.dtype=fp16")
        if device.type == "cuda":  # TF32: fp32 matmuls on tensor cores with a 10-bit mantissa (as nanoGPT)
            torch.backends.cuda.matmul.allow_tf32 = cfg.precision.tf32
            torch.backends.cudnn.allow_tf32 = cfg.precision.tf32
        p = cfg.precision
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=p.init_scale, growth_interval=p.growth_interval, enabled=dtype == "fp16"
        )
        self.overflow_steps = 0  # fp16: steps whose update the scaler skipped (inf/NaN gradients)
        self.step = 0
        self._first_step = True
        # Fault tolerance: skipped bad steps, a stop flag set by SIGTERM/SIGINT, the test hooks (loom.faults),
        # and `op`, the collective under way, named when one fails or times out.
        self.guard = StepGuard(t.max_bad_steps, t.spike_zscore, t.spike_window)
        self.stop = StopRequest(self.dp.rank, cfg.parallel.timeout_s)
        self.faults = faults.from_env()
        self.heartbeat = None  # set by run() in multi-process jobs: loom.distributed.health.Heartbeat
        self.op, self.op_step = "setup", 0  # op_step: the last step this rank began (its heartbeat)
        self.throughput = Throughput(
            flops_per_token(self.raw_model.cfg), peak_flops(device, dtype), self.dp.world_size, t.warmup_log_steps,
            compiled=t.compile,
        )  # fmt: skip
        self.metrics: Sinks | None = None  # opened with the run files, once nothing can fail cheaply

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
            "world_size": self.dp.world_size,
            "loom_version": __version__,
        }
        return tensors, state

    def save(self) -> bool:
        """Write a checkpoint (rank 0). A failed write stops the run or only warns (train.on_save_error);
        every rank learns the outcome, so all of them stop or go on together. Returns whether it was saved."""
        self.op = f"the checkpoint gather at step {self.step}"
        tensors, state = self.state()
        error = None
        if self.main:
            try:
                path = checkpoint.save(
                    self.run_dir / "ckpt", self.step, tensors, state, self.cfg.train.keep_last,
                    free_bytes=self.faults.free_bytes,
                    after_first_file=lambda tmp: self.faults.stall_save(self.step, tmp),
                )  # fmt: skip
                log.info(f"saved checkpoint {path}")
            except LoomError as e:
                error = e
        failed = error is not None
        if self.dp.world_size > 1:
            self.op = f"the checkpoint-result all-reduce at step {self.step}"
            failed = self.dp.all_reduce_sum(torch.tensor([float(failed)], device=self.device)).item() > 0
        if not failed:
            return True
        if self.cfg.train.on_save_error == "stop":
            raise error or LoomError(f"rank 0 could not write the checkpoint of step {self.step}; stopping")
        if error is not None:
            log.warn(f"checkpoint of step {self.step} not saved ({error.message}); training goes on "
                     "(train.on_save_error=continue), the next save tries again")  # fmt: skip
            if self.metrics:
                self.metrics.write({"step": self.step, "ckpt_error": error.message})
        return False

    def load(self, path: Path) -> None:
        tensors, state = checkpoint.load(path, map_location=self.device)
        saved_model = state["config"]["model"]
        defaults = Config().to_dict()["model"]
        now = self.cfg.to_dict()["model"]
        diff = [
            f"model.{k}: {saved_model.get(k)!r} -> {v!r}"
            for k, v in now.items()
            if saved_model.get(k, defaults[k]) != v  # a key added since the save: the default then
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
        self.faults.hang(self.step + 1, self.dp.rank)
        self._beat(f"the forward/backward collectives of step {self.step + 1} (gradient all-reduce)")
        xs, ys = x.to(self.device).chunk(accum), y.to(self.device).chunk(accum)
        loss_sum, dtf, dtb = torch.zeros((), device=self.device), 0.0, 0.0
        if self.dp.pipelined:  # the schedule runs its own micro-batches, forward and backward interleaved
            ta = time.perf_counter()
            loss_sum = self.dp.pipeline_step(x.to(self.device), y.to(self.device), self._autocast)
            dtf = time.perf_counter() - ta
            accum = 0
        for i in range(accum):
            last = i == accum - 1
            with self.dp.no_sync(self.model, skip=not last):
                ta = time.perf_counter()
                with self._autocast(), self.dp.loss_context():
                    loss = self.model(xs[i], ys[i]) / accum  # mean over the global batch's tokens
                self._sync()
                tb = time.perf_counter()
                with self.dp.loss_context():
                    self.scaler.scale(loss).backward()
                self._sync()
                dtf, dtb = dtf + tb - ta, dtb + time.perf_counter() - tb
            loss_sum += loss.detach()
        self.dp.after_backward()
        if self.faults.nan_at(self.step + 1, self.dp.rank):
            self.faults.poison_grad(self.raw_model)
        self.scaler.unscale_(self.optimizer)
        flags = grad_flags(self.raw_model)  # which gradients are non-finite, before clipping smears NaN
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        self.op = f"the gradient-norm and loss collectives of step {self.step + 1}"
        grad_norm = self.dp.clip_grad_norm(self.raw_model, clip)
        loss_mean = self.dp.mean_loss(loss_sum)  # before the update: a bad step is skipped on every rank
        loss, norm = loss_mean.item(), grad_norm.item()
        stop, nonfinite_anywhere = self._agree(grad_norm)
        skip = self.guard.check(
            self.step + 1, loss, math.nan if nonfinite_anywhere else norm, self.scaler.is_enabled()
        )
        bad_params = self._nonfinite_params(*flags) if skip and "non-finite" in skip else []
        if skip is None:
            self.scaler.step(self.optimizer)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.update()  # with the fp16 scaler: backs the scale off after an overflow
        overflow = scale is not None and self.scaler.get_scale() < scale  # the scaler skipped this update
        self.overflow_steps += overflow
        self.step += 1
        mem = self._model_state_report()  # before zero_grad: gradients are part of what a step holds
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        dt = time.perf_counter() - t0
        rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm, "dt": dt}
        if scale is not None:
            rec.update(
                loss_scale=self.scaler.get_scale(), overflow=overflow, overflow_steps=self.overflow_steps
            )
        if skip:
            rec.update(skipped=skip, bad_steps=self.guard.skipped, nonfinite_params=bad_params)
        if stop:
            rec["stop"] = self.stop.signal or "a signal on another rank"
        rec.update(dtf=dtf, dtb=dtb, **self.throughput.step(self.derived.tokens_per_step, dt))
        rec["tokens"] = self.step * self.derived.tokens_per_step
        rec.update(mem)
        return rec

    def _beat(self, op: str) -> None:
        """Note the collective about to run, and tell the job's store this rank reached this step."""
        self.op, self.op_step = op, self.step + 1
        if self.heartbeat is not None:
            self.heartbeat.beat(self.op_step)

    def _agree(self, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        """(stop requested on any rank, non-finite gradient on any rank): one tiny all-reduce per step, so
        every rank stops after the same step and skips the same steps."""
        flags = torch.tensor(
            [float(self.stop.requested), float(not torch.isfinite(grad_norm).item())], device=self.device
        )
        if self.dp.world_size > 1:
            self.op = f"the stop/skip all-reduce of step {self.step + 1}"
            flags = self.dp.all_reduce_sum(flags)
        return bool(flags[0].item() > 0), bool(flags[1].item() > 0)

    def _nonfinite_params(self, names: list[str], flags: torch.Tensor | None) -> list[str]:
        """Parameters whose gradient held a NaN/Inf (on any rank when every rank holds the same list)."""
        if self.dp.world_size == self.dp.size:
            return nonfinite_names(names, flags, self.dp.all_reduce_sum)
        return nonfinite_names(names, flags, lambda t: t)  # model parallel: this rank's parameters

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
        if self.dp.pipelined:
            return self.dp.pipeline_val_loss(
                self.valset, self.derived.micro_batch_size, self.device, self._autocast
            )
        with self.dp.loss_context():
            return val_loss(
                self.dp.eval_model(self.raw_model, self.model), self.valset, self.derived.micro_batch_size,
                self.device, self._autocast, self.dp.all_reduce_sum,
            )  # fmt: skip

    def sample(self, prompt: str = "", max_new_tokens: int | None = None, model=None) -> str:
        """Text from the model, with a generator of its own so training's RNG stream is untouched."""
        ids = self.tokenizer.encode(prompt) if prompt else [self.tokenizer.eot_id]
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)
        g = torch.Generator(device=self.device).manual_seed(self.cfg.run.seed + self.step)
        with self._autocast():
            out = generate(
                model or self.raw_model,
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
        write_marker(self.run_dir, "run")  # so that --force may replace this folder later, and nothing else
        self.metrics = open_sinks(self.run_dir, self.cfg)  # metrics.jsonl, and TensorBoard / W&B if asked
        (self.run_dir / "config.toml").write_text(to_toml(self.cfg), encoding="utf-8")
        copy_tokenizer(self.data_dir, self.meta, self.run_dir / "tokenizer")
        info = {
            "loom_version": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "command": sys.argv,
            "device": str(self.device),
            "world_size": self.dp.world_size,
            "data_dir": str(self.data_dir),
            "params": self.n_params,
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
            f"model {self.n_params / 1e6:.2f}M params | device {self.device} | {self.dp.describe()}"
            f" | grad accum {self.derived.grad_accum} | {self.derived.tokens_per_step:,} tokens/step"
            f" | {t.steps} steps | run {self.run_dir}"
        )
        last_val = stopped = None
        self.stop.install()
        try:
            with cpu_memory_reuse(self.device.type == "cpu" and t.reuse_cpu_memory):
                while self.step < t.steps:
                    last_val = self._one_step(last_val)
                    if self.stop_reason:
                        stopped = self.stop_reason
                        break
        finally:
            self.stop.restore()
        summary = {"step": self.step, "val_loss": last_val, **self.throughput.summary()}
        summary.update(skipped_steps=self.guard.skipped, stopped_by=stopped)
        if self.scaler.is_enabled():
            summary.update(overflow_steps=self.overflow_steps, loss_scale=self.scaler.get_scale())
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

    stop_reason: str | None = None

    def _one_step(self, last_val: float | None) -> float | None:
        """A step, then what is due after it: log, skip bookkeeping, stop on a signal, eval, sample, save."""
        t = self.cfg.train
        rec = self.train_step()
        final = self.step == t.steps
        if "compile_s" in rec:
            log.info(f"torch.compile: the first step (tracing and compiling forward and backward) took "
                     f"{rec['compile_s']:.1f}s; left out of tokens/s")  # fmt: skip
        if self._due(t.log_every) or final or "skipped" in rec or "stop" in rec:
            rec["mem_bytes"] = peak_memory_bytes(self.device)
            log.info(format_step(rec))
            if self.metrics:
                self.metrics.write(rec)
        if "skipped" in rec:
            self._after_bad_step(rec)
        if "stop" in rec:
            self.stop.disarm()  # every rank reached the end of this step
            log.info(f"stopping at step {self.step} ({rec['stop']}): saving a checkpoint", style="bold")
            saved = self.save()
            self.stop_reason = rec["stop"]
            if self.main:
                log.info(("checkpoint saved; " if saved else "no checkpoint could be saved; ")
                         + "run the same command with --resume (or train.resume=auto) to continue")  # fmt: skip
            return last_val
        if self._due(t.eval_every) or final:
            last_val = self.evaluate()
            log.info(f"step {self.step:>6} | val loss {last_val:.4f}", style="bold")
            if self.metrics:
                self.metrics.write({"step": self.step, "tokens": rec["tokens"], "val_loss": last_val})
        if (self._due(t.sample_every) or final) and self.tokenizer:
            # FSDP: every rank runs the forward passes; tensor/pipeline parallel: rank 0 gets a whole copy
            model = self.dp.sampling_model(self.raw_model)
            text = self.sample(model=model) if model is not None else None
            if self.main:
                log.info(f"--- sample at step {self.step} ---\n{text}\n---")
                with open(self.run_dir / "samples.txt", "a", encoding="utf-8") as f:
                    f.write(f"=== step {self.step}\n{text}\n")
        if self._due(t.ckpt_every) or final:
            self.save()
        return last_val

    def _after_bad_step(self, rec: dict) -> None:
        """Warn with the step and reason; after train.max_bad_steps in a row, save and stop."""
        names = rec.get("nonfinite_params") or []
        log.warn(self.guard.describe(self.step, rec["skipped"], names))
        if not self.guard.exhausted:
            return
        saved = self.save()  # the weights and optimizer are still those of the last good step
        if self.metrics:
            self.metrics.write({"step": self.step, "stopped": "max_bad_steps", "bad_steps": self.guard.bad_steps,
                                "nonfinite_params": names})  # fmt: skip
            self.metrics.close()
            self.metrics = None
        raise self.guard.stop_error(self.step, rec["skipped"], names, saved)
