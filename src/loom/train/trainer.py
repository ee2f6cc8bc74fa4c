"""The training loop: one process's view of the job.

The model is built on the meta device and handed to `loom.parallel.parallelize` with the job's layout; the
trainer then holds the model parts and asks the `Parallelized` value only what a step needs (no_sync for
accumulation, the loss context, the gradient sync and norm). What a step trains on is the training stage
(stage.py: pretraining, SFT, chosen by the data). After each step the loop asks each component what is due
(torchtitan's loop): the time budget (budget.py), the metrics logger (logger.py), the evaluators
(loom.eval.evaluator), the checkpointer (checkpointing.py, handed the Stateful parts it saves); the run folder's
files are run_files.py's; the control plane (stop and skip agreement) is `loom.distributed.comm`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shlex
import time
from pathlib import Path

import torch
import torch.nn as nn

import loom.eval.capability  # noqa: F401  (registers the evaluators it defines, as loom.generate does)
import loom.eval.hellaswag  # noqa: F401
import loom.generate  # noqa: F401
from loom import device as dev
from loom import faults, log
from loom.config import Config, Derived, to_toml
from loom.config.layout import ParallelDims
from loom.data.loader import DeviceBatches, doc_eot_id, read_meta
from loom.data.slice import DataSlice, data_slice
from loom.data.tokenizers import has_tokenizer, load_tokenizer
from loom.distributed.comm import Control
from loom.distributed.stragglers import PhaseClock, StragglerMonitor
from loom.env import cpu_memory_release, cpu_memory_reuse
from loom.errors import LoomError, StopBeforeStep
from loom.eval.evaluator import EvalContext, EvalSetup, Evaluator, build_evaluators
from loom.eval.val_loss import SourceValEval, ValLossEval
from loom.metrics import (
    DTYPES,
    Sinks,
    StepTimer,
    Throughput,
    check_bf16,
    cpu_peak_flops,
    peak_flops,
)
from loom.model.registry import spec_of
from loom.optim.schedule import lr_at
from loom.parallel import fp8, parallelize
from loom.parallel.offload import ActivationOffload
from loom.parallel.state import model_state_bytes
from loom.runs import pin_base, pretrained_state
from loom.train.budget import TimeBudget, run_length_warnings
from loom.train.checkpointing import Checkpointer, CheckpointJob, CheckpointParts, CheckpointPolicy
from loom.train.ema import EMA, EmaModelOptimState, EmaValEval
from loom.train.finetune import finetune_model, quantize_configured, training_flops_per_token
from loom.train.guard import (
    StepGuard,
    StopRequest,
    grad_flags,
    largest_grads,
    nonfinite_names,
    rows_of_step,
)
from loom.train.logger import MetricsLogger
from loom.train.memory import MemorySnapshots
from loom.train.profile import StepProfiler
from loom.train.run_files import write_run_files
from loom.train.setup import precision_reason, resolve_precision
from loom.train.stage import build_stage
from loom.train.state import ModelOptimState, RngState, TrainState


def build_model(cfg: Config, vocab_size: int, device: torch.device | str = "meta") -> nn.Module:
    """The single-device model of cfg.model's family, on the meta device by default: shapes only, no storage
    (loom.parallel materializes each rank's pieces and initialises them from run.seed)."""
    return spec_of(cfg).build_model(cfg, vocab_size, device)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        derived: Derived,
        run_dir: Path,
        data_dir: Path,
        device: torch.device,
        dims: ParallelDims | None = None,
        control: Control | None = None,
        origin: dict | None = None,
        resume: Path | None = None,
        part: DataSlice | None = None,
    ):
        """`origin`: what the run records of itself (loom.runs.origin); `resume`: the checkpoint it will be
        loaded from (trainer.load), so that the base a full fine-tuning resumes over is not read for nothing;
        `part`: the rows this process reads when they are not its layout's (a torchft replica group's)."""
        self.cfg, self.derived, self.run_dir, self.device = cfg, derived, run_dir, device
        self.origin = origin or {}
        self.dims, self.control = dims or ParallelDims(), control or Control()
        # train.memory_snapshot: the allocation history recorded from here, before any weight exists
        self.memory = MemorySnapshots(cfg, self.dims.rank, run_dir, device)
        self.meta = read_meta(data_dir)
        self.data_dir = data_dir
        t, dims = cfg.train, self.dims
        # before any weight exists: see _cpu_memory; QLoRA frees each fp32 base weight as it quantizes it
        if device.type == "cpu" and (dims.fsdp_enabled or cfg.finetune.quantize_base == "nf4"):
            cpu_memory_release()
        # first: a block_size the data cannot provide fails here, not after the model
        eot_id = doc_eot_id(data_dir, self.meta, cfg.data.doc_mask)  # data.doc_mask: None when off
        part = part or data_slice(dims, cfg.parallel.cp_layout)
        self.stage = build_stage(cfg, data_dir, self.meta, part, device)
        self.ft = None  # ft.enabled: this replica group's torchft manager (loom.distributed.ft), set by run()
        self.tokenizer = load_tokenizer(data_dir, self.meta) if has_tokenizer(self.meta) else None
        evaluators = self._evaluator_setup()  # registered ones: their inputs are checked before the model
        dtype = self.precision = self._precision()
        model = self._model(dtype, eot_id, resuming=resume is not None)
        torch.manual_seed(cfg.run.seed)  # dropout's stream: the same on every rank and every run of this seed
        self.optimizer = self.parallel.build_optimizer(cfg.optim)
        if cfg.finetune.init_optimizer:  # a resumed checkpoint's state overrides it
            self._base_optimizer()
        self.train_state = TrainState()  # the step; `step` reads and sets it
        # Fault tolerance: skipped bad steps, a stop flag set by SIGTERM/SIGINT, the test hooks (loom.faults),
        # and `op`, the collective under way, named when one fails or times out.
        self.guard = StepGuard(t.max_bad_steps, t.spike_zscore, t.spike_window)
        self.stop = StopRequest(dims.rank, cfg.parallel.timeout_s)
        self.faults = faults.from_env()
        self.heartbeat = None  # set by run() in multi-process jobs: loom.distributed.health.Heartbeat
        self.op, self.op_step = "setup", 0  # op_step: the last step this rank began (its heartbeat)
        self.throughput = self._throughput(model, dtype)
        self.logger = MetricsLogger(t.log_every, device)  # its sinks opened with the run files
        self.val = ValLossEval(self.stage.valset, self.derived.micro_batch_size, t.eval_every)
        per_source = [
            SourceValEval(name, v, self.derived.micro_batch_size, t.eval_every)
            for name, v in self.stage.source_valsets.items()
        ]  # data.mix: each source's val loss
        self.evaluators = [self.val, *per_source, *evaluators]  # after each step, in this order, when due
        self.ema = self._ema()  # train.ema: the average of the weights (None: off), evaluated beside them
        self.checkpointer = self._checkpointer()
        self._running_at_scale()

    def _throughput(self, model, dtype) -> Throughput:
        """tokens/s and MFU against the device's peak at the run's precision (a CPU's peak measured again when
        the first measure looks wrong)."""
        device, t, schedule = self.device, self.cfg.train, self.derived.schedule
        # train.seq_schedule: a row's attention costs less per token at a shorter length
        lengths = schedule.seq.values if schedule is not None else []
        self.flops_at = {n: self._flops_per_token(model, n) for n in lengths}
        return Throughput(
            self._flops_per_token(model),
            peak_flops(device, dtype),
            self.dims.world_size,
            t.warmup_log_steps,
            compiled=t.compile,
            remeasure=(lambda: cpu_peak_flops(dtype, again=True)) if device.type == "cpu" else None,
        )

    def _running_at_scale(self) -> None:
        """The components of issue 48: the straggler monitor (train.straggler_every, several ranks) and the phase
        clock it reads, activation offloading, the profiler (train.profile_*); the memory snapshots come first
        of all, in __init__."""
        t, dims, device = self.cfg.train, self.dims, self.device
        self.stragglers, waits = None, self.parallel.bucket_waits  # DDP's waits for peers (issue 59)
        if dims.world_size > 1 and t.straggler_every:
            every, k = t.straggler_every, t.straggler_windows
            self.stragglers = StragglerMonitor(
                every, t.straggler_threshold, k, self.control, self.logger.write, waits is not None
            )
        self.phases = PhaseClock(device, enabled=self.stragglers is not None, waits=waits, stalls=True)
        self.offload = ActivationOffload(device, t.activation_offload)  # saved tensors in host memory
        self.profiler = StepProfiler(self.cfg, dims.rank, dims.world_size, self.run_dir, device, self.phases)

    def _precision(self) -> str:
        """The step's dtype (precision.dtype=auto resolved for this device), its autocast, TF32 on a GPU, and
        the loss scaler (enabled for fp16)."""
        cfg, device, p = self.cfg, self.device, self.cfg.precision
        dtype = resolve_precision(p.dtype, device, loss_scaling=cfg.parallel.pp == 1)
        if p.dtype == "auto":  # the default: say what it chose and why (fp32 for exact comparisons)
            log.info(
                f"precision {dtype} (precision.dtype=auto: {precision_reason(dtype, device)}; "
                f"--precision.dtype=fp32 for fp32 everywhere)"
                if dtype != "fp32"
                else f"precision fp32 (precision.dtype=auto: {precision_reason(dtype, device)})"
            )
        if dtype == "bf16":
            check_bf16(device, "precision.dtype")
        fp8.check_device(p.fp8, device)
        dev.set_tf32(device, p.tf32)  # TF32: fp32 matmuls on tensor cores with a 10-bit mantissa (as nanogpt)
        self.scaler = torch.amp.GradScaler(
            device.type, init_scale=p.init_scale, growth_interval=p.growth_interval, enabled=dtype == "fp16"
        )
        self.overflow_steps = 0  # fp16: steps whose update the scaler skipped (inf/NaN gradients)
        return dtype

    @property
    def batches(self) -> DeviceBatches:
        """This rank's training batches on the device (the stage's)."""
        return self.stage.batches

    def _model(self, dtype: str, eot_id: int | None, resuming: bool) -> torch.nn.Module:
        """The family's model, built on the meta device and parallelized (each rank materializes and initialises
        its pieces), imported weights loaded if model.init_from asks (a resumed checkpoint overrides them).
        `eot_id`: the documents' separator with data.doc_mask; `resuming`: a checkpoint will be loaded."""
        cfg = self.cfg
        self.spec = spec_of(cfg)  # the model family: everything the trainer asks about the model
        model = self.spec.build_model(cfg, self.meta["vocab_size"], eot_id=eot_id)
        self.lora = finetune_model(model, cfg, self.meta)  # LoRA's adapted linears ([]: every weight trains)
        self.n_params = model.num_params()  # before parallelize: pipeline parallel keeps only its stages
        # what a token passes through (a mixture of experts: k of its routed experts); MFU counts these
        self.n_active = self.spec.active_params(model)
        init = functools.partial(model.init_param, seed=cfg.run.seed)  # (name, whole): seeded by name
        # QLoRA (finetune.quantize_base=nf4): the base made, read and quantized module by module before the
        # layout, which then shards the NF4 weights (FSDP) or keeps them (one process)
        qlora = quantize_configured(model, cfg, self.spec, self.device, init)
        self.parallel = parallelize(
            model,
            self.dims,
            cfg,
            self.device,
            self.spec,
            precision=dtype,
            n_microbatches=self.derived.pp_microbatches,
            init=init,
        )
        # a resumed checkpoint holds every weight but a LoRA run's frozen base: only that is read from the base
        pretrained = None if qlora or (resuming and not self.lora) else pretrained_state(cfg, model)
        if pretrained is not None:
            self.parallel.load_model_state(pretrained)
        del pretrained
        self.model = self.parallel.model
        return model

    @property
    def main(self) -> bool:
        """Rank 0: the rank that writes the run's files and logs."""
        return self.dims.is_main

    @property
    def step(self) -> int:
        """Optimizer steps taken (held by the train state, which checkpoints save and resume)."""
        return self.train_state.step

    @step.setter
    def step(self, value: int) -> None:
        self.train_state.step = value

    def _checkpointer(self) -> Checkpointer:
        """The checkpoint component, handed the parts it saves and the hooks it reports through."""
        parts = CheckpointParts(
            model_optim=(
                ModelOptimState(self.parallel, self.optimizer)
                if self.ema is None
                else EmaModelOptimState(ModelOptimState(self.parallel, self.optimizer), self.ema)
            ),
            loader=self.batches,
            scaler=self.scaler,
            rng=RngState(self.device),
            train=self.train_state,
        )
        job = CheckpointJob(
            config=self.cfg,
            world_size=self.dims.world_size,
            is_main=self.main,
            device_type=self.device.type,
            control=self.control,
            faults=self.faults,
            record=self.logger.write,
            name_op=self._name_op,
            origin=self.origin,
            finishing=self.stop.finishing,
        )
        return Checkpointer(parts, CheckpointPolicy.of(self.cfg, self.run_dir), job)

    def _ema(self) -> EMA | None:
        """train.ema: the moving average of the weights, its validation loss due with val_loss's."""
        if not self.cfg.train.ema:
            return None
        ema = EMA(self.parallel, self.cfg.train.ema)
        every = self.cfg.train.eval_every
        self.evaluators.insert(1, EmaValEval(ema, self.stage.valset, self.derived.micro_batch_size, every))
        return ema

    def _name_op(self, op: str) -> None:
        self.op = op

    def load(self, path: Path) -> None:
        self.checkpointer.load(path)

    def _base_optimizer(self) -> None:
        """finetune.init_optimizer: the optimizer state of the run model.init_from=run:DIR names (its newest
        checkpoint's optim/, read by each rank for its own pieces, whatever layout wrote it)."""
        from loom import checkpoint
        from loom.parallel import dcp_state
        from loom.runs import base_checkpoint, run_dir_of

        path = base_checkpoint(self.cfg) or checkpoint.latest_valid(run_dir_of(self.cfg) / "ckpt")
        if path is None or not checkpoint.is_sharded(path):
            raise LoomError(
                f"finetune.init_optimizer: '{run_dir_of(self.cfg)}' has no sharded checkpoint with an optimizer "
                "state (a consolidated or format-1 run has none to give)",
                hint="drop finetune.init_optimizer, or start from a run that saved checkpoints",
            )
        dcp_state.load_optim_shards(self.parallel.model, self.optimizer, path / "optim", self.parallel.tied)
        log.info(f"optimizer state from {path}")

    def _flops_per_token(self, model: torch.nn.Module, seq_len: int | None = None) -> float:
        """The family's training FLOPs per token in rows of seq_len tokens (None: model.block_size; LoRA: the
        frozen matrices get no weight gradient)."""
        flops = self.spec.flops_per_token(model.cfg, seq_len)
        return training_flops_per_token(self.cfg, self.meta, model.cfg, flops, self.lora)

    # ---------------------------------------------------------------- steps
    def _autocast(self):
        if self.precision == "fp32":  # autocast for bf16 / fp16
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.precision])

    @contextlib.contextmanager
    def _eval_precision(self):
        """Evaluation and sampling: autocast, with any float8 linears computing in high precision."""
        with self.parallel.high_precision(), self._autocast():
            yield

    def train_step(self) -> dict:
        """One optimizer step over the global batch: accumulate micro-batches, clip, step."""
        # Per-micro-batch timing: free on a CPU; on a GPU only with metrics.detail (CUDA events, one read).
        timing = self.device.type not in dev.ASYNC or self.cfg.metrics.detail
        par, timer = self.parallel, StepTimer(self.device, timing)
        t0, phase, rank = time.perf_counter(), self.phases, self.dims.rank
        if self.ft is not None:  # the step's quorum (part of its time); a group behind the others heals here
            if self.ft.manager is None:  # this process's first step: it joins (compiled first, coming back)
                self.ft.join()
            with phase("wait", host=True):
                self.ft.begin_step()
        lr = self._set_lr()  # after the quorum: of the step a group healed to
        with phase("data", host=True):
            self.batch_state = (
                self.batches.state_dict()
            )  # where this batch starts (a bad step names its rows)
            x, y = self.batches.next_batch()
            y = self.faults.corrupt(self.step + 1, y, self.meta["vocab_size"])
            self.faults.slow("data", rank)
        self._begin_step()
        loss_sum = self._forward_backward(x, y, timer)
        with timer("c"), phase("comm"):  # exposed communication: what the backward did not overlap
            par.sync_grads()
            if self.ft is not None:
                self.ft.sync_grads(self.model, loss_sum)  # the loss: the quorum's mean
        if self.faults.nan_at(self.step + 1, self.dims.rank):
            self.faults.poison_grad(self.model)
        self.scaler.unscale_(self.optimizer)
        flags = grad_flags(self.model)  # which gradients are non-finite, before clipping smears NaN
        self.op = f"the gradient-norm and loss collectives of step {self.step + 1}"
        # clipping: the update's first part; its norm's all-reduce is a wait (Parallel.blocked)
        with phase("optimizer"):
            grad_norm = par.clip_grad_norm(self.cfg.optim.grad_clip or math.inf)
        # the step's one host read; then every rank agrees on stop and skip before the update: both wait
        with phase("wait"):  # for the slowest rank (the straggler monitor's `wait`)
            loss, norm = torch.stack([par.mean_loss(loss_sum).float(), grad_norm.float()]).tolist()
        with phase("wait", host=True):
            stop, nonfinite = self._agree_stop_or_skip(norm)
        skip = self._check_step(loss, norm, nonfinite)
        if skip is None:
            with phase("optimizer"):
                self.faults.slow("optimizer", rank)
                self.scaler.step(self.optimizer)
            par.refresh_fp8_scales()
        overflow_scale = self._update_scaler()
        self.step += 1
        with timer("c"):
            synced = par.after_update(self.step)  # bytes all-reduced; DiLoCo's outer step when due
        if self.ema is not None and skip is None:  # train.ema: after the weights of this step are final
            self.ema.update()
        rec = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": norm, **timer.read(), **synced}
        if self.offload.enabled:  # what the saved-tensor hooks moved to host memory (on a CPU: would have)
            rec["offloaded_bytes"] = self.offload.reset()
        rec.update(self.stage.step_metrics(par.all_reduce_sum))  # DPO: rewards, margin, accuracy
        rec.update(par.after_step(update=skip is None))  # the family's (MoE: balance bias and expert load)
        rec.update(self._model_state_report())  # before zero_grad: gradients are part of what a step holds
        self.optimizer.zero_grad(set_to_none=True)
        return self._record(rec, time.perf_counter() - t0, skip, stop, flags, overflow_scale)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, timer: StepTimer) -> torch.Tensor:
        """The global batch's forward and backward (accumulated micro-batches, or the pipeline's schedule);
        returns the summed loss (on the device)."""
        par, accum, phase, rank = self.parallel, self._grad_accum(self.step), self.phases, self.dims.rank
        if par.pipeline is not None:  # the schedule runs its micro-batches, forward and backward interleaved
            with timer("f"), phase("forward"):
                self.faults.slow("forward", rank)
                with self.offload():
                    return par.pipeline.step(x, y, self._autocast, self.stage.pipeline_weight())
        loss_sum = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            with par.no_sync(skip=i < accum - 1), par.loss_context():
                with timer("f"), phase("forward"), self._autocast(), self.offload():
                    self.faults.slow("forward", rank)
                    self.faults.oom(self.step + 1)
                    loss = self.stage.micro_loss(par.forward, xm, ym, i, accum)
                with timer("b"), phase("backward"):
                    self.faults.slow("backward", rank)
                    self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        return loss_sum

    def warm_up(self) -> float:
        """One forward and backward of the next step's batch, thrown away (the loader rewound, the random state
        kept, the gradients and a MoE layer's load counts dropped, the phase times discarded; weights and
        optimizer untouched): torch.compile traces and compiles here, not inside a step the others wait on.
        Returns its seconds."""
        t0, state = time.perf_counter(), self.batches.state_dict()
        x, y = self.batches.next_batch()
        self.batches.load_state_dict(state)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self._forward_backward(x, y, StepTimer(self.device, False))
        self.optimizer.zero_grad(set_to_none=True)
        for m in self.model.modules():
            if hasattr(m, "forget_load"):
                m.forget_load()
        if self.offload.enabled:
            self.offload.reset()
        self.phases.take()
        return time.perf_counter() - t0

    def _grad_accum(self, step: int) -> int:
        """Micro-batches of 0-based step `step`: train.batch_schedule's batch of that step over dp x
        micro_batch_size (each micro-batch the same size whatever the batch), else the run's constant."""
        d = self.derived
        if d.schedule is None:
            return d.grad_accum
        return d.schedule.windows(step) // (d.dp_size * d.micro_batch_size)

    def _count_tokens(self, rec: dict, dt: float) -> None:
        """The step's tokens/s and MFU, and the tokens trained on so far (`tokens`); with a schedule, the step's
        batch in sequences and row length too, and its FLOPs at that length."""
        trained = getattr(self.stage, "trained_tokens", None)  # loom rl: its answers' trained targets
        schedule = self.derived.schedule
        if schedule is None:
            tokens = self.derived.tokens_per_step if trained is None else trained
            rec.update(dt=dt, **self.throughput.step(tokens, dt))
            rec["tokens"] = self.step * self.derived.tokens_per_step
            return
        s = self.step - 1  # the step just taken, 0-based
        tokens, length = schedule.tokens(s), schedule.seq_len(s)
        rec.update(dt=dt, **self.throughput.step(tokens, dt, tokens * self.flops_at[length]))
        rec.update(tokens=schedule.tokens_before(self.step), batch_size=schedule.windows(s), seq_len=length)

    def _check_step(self, loss: float, norm: float, nonfinite: bool) -> str | None:
        """Why this step's update is skipped (None: it is applied): the bad-step guard's verdict, then, under
        ft, the quorum's (a step it does not commit skips its rows, recorded like a bad step)."""
        skip = self.guard.check(
            self.step + 1, loss, math.nan if nonfinite else norm, self.scaler.is_enabled()
        )
        if self.ft is not None and not self.ft.commit(local_ok=skip is None):
            skip = skip or "ft: the quorum did not commit this step (a replica group failed in it)"
        return skip

    def _set_lr(self) -> float:
        o = self.cfg.optim
        lr = lr_at(
            self.step, o.lr, o.end_lr(), o.warmup_steps, self.cfg.train.steps, o.schedule, o.decay_frac
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)  # μP's per-group multipliers (loom.model.mup)
        return lr

    def _begin_step(self) -> None:
        """Fault hooks (a hang), and the heartbeat that names this step if a collective later fails."""
        self.faults.hang(self.step + 1, self.dims.rank)
        self._beat(f"the forward/backward collectives of step {self.step + 1} (gradient all-reduce)")

    def _update_scaler(self) -> float | None:
        """fp16: the scaler backs its scale off after an overflow. Returns the scale the step used."""
        if not self.scaler.is_enabled():
            return None
        scale = self.scaler.get_scale()
        self.scaler.update()
        return scale

    def _record(self, rec: dict, dt: float, skip, stop: bool, flags, scale: float | None) -> dict:
        """The step's metrics record: time, throughput, loss scale, skips and stops."""
        if scale is not None:
            overflow = self.scaler.get_scale() < scale  # the scaler skipped this update
            self.overflow_steps += overflow
            rec.update(
                loss_scale=self.scaler.get_scale(), overflow=overflow, overflow_steps=self.overflow_steps
            )
        if self.ft is not None:  # the groups the step averaged over; quorum changes, recorded before it
            for change in self.ft.records(rec):
                self.logger.write(change)
        if skip:
            names, nonfinite, norms = flags
            bad = self._nonfinite_params(names, nonfinite) if "non-finite" in skip else []
            rec.update(skipped=skip, bad_steps=self.guard.skipped, nonfinite_params=bad)
            rec.update(self._explain(names, norms))
        elif (
            self.guard.note
        ):  # a spike the guard does not skip (train.spike_zscore off): recorded all the same
            names, _, norms = flags
            rec.update(spike=self.guard.note, **self._explain(names, norms))
        if stop:
            rec["stop"] = self.stop.signal or "a signal on another rank"
        # loom rl: its answers' trained targets, not the padded batch_size x block_size
        self._count_tokens(rec, dt)
        mix = self.stage.batches.state_dict().get("mix")
        if mix:  # data.mix: the tokens each source gave so far (rows of block_size targets)
            rec["mix_tokens"] = {m["name"]: m["cursor"] * self.cfg.model.block_size for m in mix}
        return rec

    def _beat(self, op: str) -> None:
        """Note the collective about to run, and tell the job's store this rank reached this step."""
        self.op, self.op_step = op, self.step + 1
        if self.heartbeat is not None:
            self.heartbeat.beat(self.op_step)

    def _agree_stop_or_skip(self, grad_norm: float) -> tuple[bool, bool]:
        """(stop requested on any rank, non-finite gradient on any rank): one tiny control-plane all-reduce per
        step, so every rank stops after the same step and skips the same steps."""
        self.op = f"the stop/skip agreement of step {self.step + 1}"
        stop, bad = self.control.all_reduce_sum(
            [float(self.stop.requested), float(not math.isfinite(grad_norm))]
        )
        return stop > 0, bad > 0

    def _nonfinite_params(self, names: list[str], flags: torch.Tensor | None) -> list[str]:
        """Parameters whose gradient held a NaN/Inf (on any rank when every rank holds the same list)."""
        if self.dims.model_parallel:
            return nonfinite_names(names, flags, lambda t: t)  # this rank's parameters
        return nonfinite_names(names, flags, self.parallel.all_reduce_sum)

    def _explain(self, names: list[str], norms: torch.Tensor | None) -> dict:
        """What a bad step can say of its cause: the global rows of its batch (and the command that prints
        them), the parameters with the largest gradient norms (whole norms under FSDP; a model-parallel rank's
        own parameters otherwise). The learning rate is in the step's record already."""
        bs, align = self.cfg.train.batch_size, self.cfg.data.align
        if self.derived.schedule is not None:  # train.batch_schedule: the batch of the step just taken
            bs = self.derived.schedule.windows(self.step - 1)
        # data.mix's, SFT's loaders and RL's rollouts say which rows they gave in their own terms
        explain = getattr(getattr(self.batches, "loader", self.batches), "explain_rows", None)
        out = (
            explain(self.batch_state, bs, align)
            if explain
            else rows_of_step(self.batch_state, bs, self.data_dir, align)
        )
        if norms is not None:
            if self.dims.fsdp_enabled and not self.dims.model_parallel:  # each rank holds a shard of each
                norms = self.parallel.all_reduce_sum(norms.float() ** 2).sqrt()
            out["top_grads"] = largest_grads(names, norms.tolist())
        return out

    def _model_state_report(self) -> dict:
        """mem_params/grads/optim: bytes this rank holds (its shards), on the first and every logged step."""
        first = self.logger.first
        if not (first or self.logger.due(self.step, self.step == self.cfg.train.steps)):
            return {}
        m = model_state_bytes(self.model, self.optimizer)
        if first:
            self.logger.first = False
            log.info(
                f"rank {self.dims.rank} model state: params {m['params'] / 2**20:.1f} MiB, grads "
                f"{m['grads'] / 2**20:.1f} MiB, optimizer {m['optim'] / 2**20:.1f} MiB (this rank's share)"
            )
        return {f"mem_{k}": v for k, v in m.items()}

    def _evaluator_setup(self) -> list[Evaluator]:
        """Every registered evaluator this run's config asks for (loom.eval.evaluator.register_evaluator)."""
        spec = spec_of(self.cfg)
        setup = EvalSetup(
            self.cfg,
            self.tokenizer,
            self.data_dir,
            self.run_dir,
            self.main,
            spec.config(self.cfg, self.meta["vocab_size"]),
            spec,
            self.stage,
        )
        return build_evaluators(setup)

    def eval_context(self) -> EvalContext:
        return EvalContext(self.parallel, self.device, self.step, self._eval_precision, self.tokenizer)

    # ---------------------------------------------------------------- the run
    def _write_run_files(self) -> Sinks:
        """Rank 0's run folder (loom.train.run_files), written once nothing can fail cheaply: its sinks; and a
        LoRA run's mark on its base checkpoint (loom.runs.pin_base)."""
        if "run_id" in self.origin:
            pin_base(self.cfg, self.run_dir, self.origin["run_id"])
        return write_run_files(
            self.run_dir,
            self.cfg,
            self.data_dir,
            self.meta,
            device=self.device,
            world_size=self.dims.world_size,
            n_params=self.n_params,
            flops_per_token=self.throughput.flops_per_token,
            active_params=self.n_active,
            origin=self.origin,
        )

    def _save_config(self) -> None:
        """config.toml again, after a component changed the config (train.time_budget_s chose train.steps)."""
        if self.main:
            (self.run_dir / "config.toml").write_text(to_toml(self.cfg), encoding="utf-8")

    def _cpu_memory(self):
        """glibc's malloc for this layout on a CPU. Unsharded: keep freed memory for reuse (train.reuse_cpu_memory:
        activations are not page-faulted in again every step). Sharded (FSDP, ZeRO-2, HSDP): give large blocks back
        instead, since FSDP's gathered-block buffers (MBs each, every block, every step) otherwise pile up
        fragmented in the heap: on 4 ranks of a 6x768 model the largest rank peaked at 1.74-1.97 GB with
        ~0.39 GB live."""
        if self.device.type != "cpu" or self.dims.fsdp_enabled:  # sharded: released since __init__
            return contextlib.nullcontext(False)
        return cpu_memory_reuse(self.cfg.train.reuse_cpu_memory)

    def train(self) -> dict:
        t = self.cfg.train
        if self.main:
            self.logger.open(self._write_run_files(), self.step)
        self._say_shape()
        log.info(f"run folder: {self.run_dir} (config.toml, metrics.jsonl, checkpoints, samples)")
        if self.parallel.fp8:
            gather = ", FSDP all-gathers them in float8" if self.parallel.fp8_gather else ""
            fp8_peak = peak_flops(self.device, "fp8") if self.device.type == "cuda" else None
            vs = f" (the fp8 peak: {fp8_peak / 1e12:,.0f} TFLOP/s)" if fp8_peak else ""
            log.info(
                f"fp8 ({self.cfg.precision.fp8}): {len(self.parallel.fp8)} linears in float8{gather}; "
                f"MFU is against the {self.precision} peak{vs}"
            )
        self.parallel.refresh_fp8_scales()  # after init or the resumed checkpoint's weights
        self.stage.begin(
            self.parallel, self._autocast
        )  # DPO: the reference log-probabilities; RL: its sampler
        if self.step == 0:  # a new run: evaluators with a baseline measure the start model (rl's pass@k)
            self._evaluate(0, final=False, baseline=True)
        self.budget = TimeBudget(
            self.cfg,
            self.step,
            self.control.broadcast_object,
            self._save_config,
            self._say_run_length,
            self.derived.schedule,
        )
        if not self.budget.active:  # else once the budget has chosen train.steps
            self._say_run_length()
        stopped = None
        self.stop.install()
        self.logger.begin(self.step, t.steps)
        try:
            with self._cpu_memory():
                while self.step < t.steps and stopped is None:
                    stopped = self._one_step()
        finally:
            self.logger.end()  # the terminal's progress line, before anything else prints
            self.stop.restore()
            self.stage.end()  # RL's rollout worker (rl.max_staleness) stops here
        last_val = self.val.last
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
        if self.main:
            self._say_next()
        self.logger.write({"summary": summary})
        self.logger.close()
        return summary

    def _say_shape(self) -> None:
        """The run's first line: the model, the layout, the batch; and a batch or length schedule's ramp."""
        active = f" ({self.n_active / 1e6:.2f}M active per token)" if self.n_active != self.n_params else ""
        log.info(
            f"model {self.n_params / 1e6:.2f}M params{active} | device {self.device} | {self.dims.describe()}"
            f" | grad accum {self.derived.grad_accum} | {self.derived.tokens_per_step:,} tokens/step"
            f" | {self.cfg.train.steps} steps"
        )
        if self.derived.schedule is not None:  # train.batch_schedule / seq_schedule
            log.info(f"warm-up: {self.derived.schedule.describe()}; the line above is the last step's batch")

    def _say_next(self) -> None:
        """The run's folder and what to do with it, the run's last lines."""
        from loom.data.sft import is_chat_data

        run = shlex.quote(str(self.run_dir))
        talk = f"loom chat {run}" if is_chat_data(self.meta) else f"loom generate {run}"
        log.info(f"run folder: {self.run_dir}")
        log.info(f"next: {talk}  |  loom plot {run}  |  loom eval {run}")

    def _say_run_length(self) -> None:
        """Rank 0's warnings about what the run's length hides (loom.train.budget.run_length_warnings)."""
        # pretraining's ShardLoader (a mixture's MixLoader.windows is a method: its check_repeats says it)
        windows = getattr(getattr(getattr(self.batches, "loader", None), "windows", None), "n", None)
        rows_per_step = self.derived.tokens_per_step // self.cfg.model.block_size
        schedule = self.derived.schedule
        rows_before = schedule.windows_before if schedule is not None else None
        for line in run_length_warnings(self.cfg, windows, rows_per_step, rows_before):
            if self.main:
                log.warn(line)

    def _one_step(self) -> str | None:
        """A step, then each component in turn decides what is due after it (torchtitan's loop): the time
        budget, the logger, the bad-step guard, a stop on a signal, each evaluator, the checkpointer. Returns
        why the run stops here (a signal), else None."""
        self.profiler.before_step(self.step + 1)
        try:
            rec = self.train_step()
        except torch.OutOfMemoryError as e:  # the snapshot (train.memory_snapshot), then a named exit
            raise self.memory.out_of_memory(self.step + 1, e) from None
        except StopBeforeStep as e:  # a signal while the stage made the batch (a hung RL reward): not taken
            return self._stop(e.why)
        if self.stragglers is not None:
            self.stragglers.after_step(self.step, self.phases.take(rec["dt"]))
        self.budget.after_step(self.step, rec["dt"])  # train.time_budget_s may set train.steps here
        final = self.step == self.cfg.train.steps
        self.logger.after_step(rec, final, self.cfg.train.steps)
        if "skipped" in rec:
            self._after_bad_step(rec)
        elif "spike" in rec:
            log.warn(f"step {self.step}: {rec['spike']}, recorded, not skipped (train.spike_zscore is 0)")
            self._explain_warning(rec)
        if "stop" in rec:
            return self._stop(rec["stop"])
        self._evaluate(rec["tokens"], final)
        with self.phases("checkpoint"):
            self.checkpointer.after_step(self.step, final)
        self.profiler.after_step(self.step, final)
        self.memory.after_step(self.step)
        return None

    def _evaluate(self, tokens: int, final: bool, baseline: bool = False) -> None:
        """Every evaluator that is due after this step (`baseline`: before the first, those whose `baseline` is
        set); rank 0 logs and records what each found."""
        ctx = self.eval_context()
        for ev in self.evaluators:
            if getattr(ev, "baseline", False) if baseline else ev.due(self.step, final):
                found = ev.run(ctx)
                if self.main and found:
                    log.info(ev.line(self.step, found), style="bold")
                    if ev.in_metrics:
                        self.logger.write({"step": self.step, "tokens": tokens, **found})

    def _stop(self, why: str) -> str:
        """A stop signal every rank agreed on at the end of this step: the stop checkpoint, then out."""
        self.stop.disarm()  # every rank reached the end of this step
        if not self.parallel.replicas_equal(self.step):
            log.warn(
                f"stopping at step {self.step} ({why}), between DiLoCo's outer steps: the replicas differ, so no "
                "checkpoint is written here; --resume continues from the last outer step's"
            )
            return why
        log.info(f"stopping at step {self.step} ({why}): saving a checkpoint", style="bold")
        self.checkpointer.save_last("stop")  # saved, or an error that says what is not
        if self.main:
            log.info(
                "checkpoint saved; run the same command with --resume (or train.resume=auto) to continue"
            )
        return why

    def _explain_warning(self, rec: dict) -> None:
        """The console line of a bad step's or a spike's record: lr, its batch's rows, the largest gradients."""
        grads = ", ".join(f"{n} {g:.3g}" for n, g in rec.get("top_grads", []))
        rows = ""
        if "rows" in rec:
            rows = f"its batch is rows {rec['rows'][0]}-{rec['rows'][1]} ({rec['inspect']}); "
        elif "prompts" in rec:  # loom rl: a rollout
            rows = f"its rollout's prompts are rl.prompts rows {rec['prompts']}; "
        log.warn(f"step {self.step}: lr {rec['lr']:.3g}; {rows}largest gradient norms: {grads or 'none'}")

    def _after_bad_step(self, rec: dict) -> None:
        """Warn with the step and reason; after train.max_bad_steps in a row, save and stop."""
        names = rec.get("nonfinite_params") or []
        log.warn(self.guard.describe(self.step, rec["skipped"], names))
        self._explain_warning(rec)
        if not self.guard.exhausted:
            return
        # the weights and optimizer are still those of the last good step (DiLoCo: only after an outer step)
        saved = self.parallel.replicas_equal(self.step) and self.checkpointer.save()
        record = {"stopped": "max_bad_steps", "bad_steps": self.guard.bad_steps, "nonfinite_params": names}
        self.logger.write({"step": self.step, **record})
        self.logger.close()
        raise self.guard.stop_error(self.step, rec["skipped"], names, saved)
