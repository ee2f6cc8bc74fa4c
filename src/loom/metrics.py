"""Throughput, MFU, memory, and the metric sinks (console line, metrics.jsonl, TensorBoard, W&B).

MFU = achieved model FLOP/s / peak FLOP/s. Peaks come from a table of dense (no sparsity) datasheet figures
for known GPUs; on CPUs a matmul is measured once per machine, thread count and dtype, and cached. An
unknown device has no MFU (None, shown as n/a), never a guessed default.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loom import device as dev
from loom.errors import LoomError
from loom.paths import cache_dir

FP8_MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada, Hopper, Blackwell (precision.fp8, loom doctor)
# the CUDA rows of loom.dev.PEAK_TFLOPS (the one table, by device type)
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = dev.PEAK_TFLOPS["cuda"]

# precision names (precision.dtype, parallel.param_dtype, the peak table) -> torch dtypes: the one map
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def has_bf16(device: torch.device) -> bool:
    """This GPU computes in bf16 (the one test of it: eval's autocast, precision.dtype=auto, and check_bf16)."""
    return dev.has_bf16(device)


def check_bf16(device: torch.device, key: str) -> None:
    """A config key that asks for bf16 (precision.dtype, parallel.param_dtype) on a GPU without it: refused."""
    if dev.lacks_bf16(device):
        raise LoomError(f"{key}=bf16 but this GPU has no bf16", hint=f"use {key}=fp16 (or fp32)")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_flops(
    device: torch.device, dt: torch.dtype, n: int = 256, reps: int = 5, generator=None, clock=None
) -> float:
    """A rough FLOP/s of an n x n matmul, to size a measurement: the best of `reps` timed products (2·n³ FLOPs
    each) after a warm-up. One product takes ~0.2 ms on a CPU; timed once, a single stall of one of its threads
    (another process given the core for a scheduler slice, 4-16 ms) read as ~100x too slow (`loom bench peak`
    once left out every size but the smallest, 'too slow at 2.1 GFLOP/s' on a CPU doing 180)."""
    clock = clock or time.perf_counter
    a = torch.randn(n, n, device=device, dtype=dt, generator=generator)
    a @ a
    dev.synchronize(device)
    best = 0.0
    for _ in range(reps):
        t0 = clock()
        a @ a
        dev.synchronize(device)
        best = max(best, 2 * n**3 / max(clock() - t0, 1e-9))
    return best


def measure_matmul_flops(device: torch.device, dtype: str, n: int = 2048, seconds: float = 1.0) -> float:
    """Best FLOP/s of an n x n matmul on `device` over ~`seconds` (after a warm-up).

    n shrinks when one product would take more than a tenth of the budget (fp16 on a CPU runs at a few
    GFLOP/s), so the measurement always ends in about `seconds`.
    """
    dt = DTYPES[dtype]

    def sync():
        dev.synchronize(device)

    # A generator of its own: measuring must not move the global RNG, or a run's dropout masks would
    # depend on whether the peak was cached.
    g = torch.Generator(device=device).manual_seed(0)
    rate = probe_flops(device, dt, generator=g)
    n = max(256, min(n, int((rate * seconds / 10 / 2) ** (1 / 3)) // 64 * 64))
    a = torch.randn(n, n, device=device, dtype=dt, generator=g)
    b = torch.randn(n, n, device=device, dtype=dt, generator=g)
    a @ b
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def cpu_peak_key(dtype: str) -> str:
    """cpu_peak_flops' cache key: the machine, thread count, torch version and dtype."""
    return f"{_cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"


def cpu_peak_flops(dtype: str, again: bool = False) -> float:
    """Measured CPU matmul peak for this machine, thread count, torch version and dtype (cached in JSON).
    `again`: measure once more and keep the higher of the two (a peak measured on a busy machine is too low,
    which shows as an impossible MFU; a measurement can only be too low, so the highest is the best one)."""
    key = cpu_peak_key(dtype)
    path = cache_dir() / "cpu_peak.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        table = {}
    if key not in table or again:
        table[key] = max(float(table.get(key, 0.0)), measure_matmul_flops(torch.device("cpu"), dtype))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
        except OSError as e:  # a cache: an unwritable one costs a measurement per run, never the run
            from loom import log

            log.warn_once(f"cannot cache the CPU peak in '{path}' ({e.strerror or e}): measured on every run")
    return float(table[key])


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s for MFU, or None when the device is unknown."""
    if device.type == "cpu":
        return cpu_peak_flops(dtype)
    tflops = dev.peak_tflops(device, dtype)
    return tflops * 1e12 if tflops is not None else None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory; on CPU the process's peak resident set size."""
    return dev.peak_memory(device)


class Throughput:
    """Tokens/s and MFU per step, and a summary that leaves out the first `skip` steps (warm-up).

    With `compiled`, the first step is where torch.compile traces and compiles forward and backward: its
    time is reported apart as `compile_s` (the whole first step) and never counted, whatever `skip` says."""

    def __init__(
        self,
        flops_per_token: int,
        peak: float | None,
        n_devices: int,
        skip: int,
        compiled: bool = False,
        remeasure: Callable[[], float] | None = None,
    ):
        """`remeasure`: a measured peak can be re-measured (CPU): called once if a step's MFU exceeds 100%."""
        self.flops_per_token, self.peak, self.n_devices = flops_per_token, peak, n_devices
        self.remeasure = remeasure
        self.skip = max(skip, 1) if compiled else skip
        self.compiled, self.compile_s = compiled, None
        self.steps, self.tokens, self.seconds = 0, 0, 0.0
        self.flops = 0.0  # the counted steps' FLOPs (their tokens x flops_per_token, unless a step said)
        self.warned = False

    def step(self, tokens: int, dt: float, flops: float | None = None) -> dict:
        """`flops`: the step's training FLOPs when they are not tokens x flops_per_token (a step of shorter
        rows: train.seq_schedule, whose attention costs less per token)."""
        self.steps += 1
        flops = tokens * self.flops_per_token if flops is None else flops
        if self.steps > self.skip:
            self.tokens += tokens
            self.seconds += dt
            self.flops += flops
        tps = tokens / dt if dt > 0 else 0.0
        per_token = flops / tokens if tokens else self.flops_per_token
        rec = {
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / self.n_devices,
            "mfu": self.mfu(tps, per_token),
        }
        if self.compiled and self.steps == 1:
            self.compile_s = dt
            rec["compile_s"] = dt
        return rec

    def mfu(self, tokens_per_s: float, flops_per_token: float | None = None) -> float | None:
        if self.peak is None:
            return None
        flops_per_token = flops_per_token or self.flops_per_token
        mfu = tokens_per_s * flops_per_token / (self.peak * self.n_devices)
        if mfu > 1.0 and self.remeasure is not None:  # impossible: the cached peak is too low; mend it, once
            from loom import log

            old, self.peak, self.remeasure = self.peak, self.remeasure(), None
            log.info(
                f"MFU {100 * mfu:.0f}% is impossible: the cached matmul peak ({old / 1e9:.0f} GFLOP/s) was "
                f"measured on a busy machine; measured again: {self.peak / 1e9:.0f} GFLOP/s (kept if higher)"
            )
            mfu = tokens_per_s * flops_per_token / (self.peak * self.n_devices)
        if mfu > 1.0 and not self.warned:
            self.warned = True
            from loom import log

            log.warn(
                f"MFU above 100%: this step ran faster than the peak ({self.peak / 1e9:.0f} GFLOP/s per "
                "device) allows: the peak of this device (table or measurement) is wrong"
            )
        return mfu

    def summary(self) -> dict:
        out = {} if self.compile_s is None else {"compile_s": self.compile_s}
        if self.seconds == 0:
            return out
        tps = self.tokens / self.seconds
        return {
            **out,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / self.n_devices,
            "mfu": self.mfu(tps, self.flops / self.tokens if self.tokens else None),
        }


class JsonlSink:
    """Appends one JSON object per line; the machine-readable truth that `loom plot` reads."""

    def __init__(self, path: str | Path):
        self.f = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.f.close()


def read_jsonl(path: str | Path, superseded: bool = False) -> list[dict]:
    """The records of a JSONL file. A last line without its newline is left out: the run is writing it (a read
    beside a write can see part of it) or was killed in the middle of it.

    A resumed run writes `{"resumed_from": S}` (its checkpoint's step) before its first step: the records of
    steps after S written before that line belong to the attempt that was abandoned (those steps are trained
    again) and are left out, so every reader (`loom plot`, verify, ...) sees one timeline, never a curve that
    doubles back. Nothing is deleted from the file; `superseded=True` returns every record as written."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")[:-1]  # the piece after the last newline is not a whole record yet
    records = [json.loads(line) for line in lines if line.strip()]
    if superseded:
        return records
    out: list[dict] = []
    for rec in records:
        if isinstance(rec.get("resumed_from"), int):
            out = [r for r in out if (_step_of(r) or 0) <= rec["resumed_from"]]
        out.append(rec)
    return out


def _step_of(record: dict) -> int | None:
    """The step a record belongs to (a summary: the step the run ended at)."""
    step = record.get("step")
    if step is None and isinstance(record.get("summary"), dict):
        step = record["summary"].get("step")
    return step if isinstance(step, int) else None


def clock(seconds: float) -> str:
    """A duration as people read it: 45s, 3m05s, 2h07m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_step(rec: dict, total: int | None = None, eta_s: float | None = None) -> str:
    """The console line for a training record (loom rl's: its reward and held-out pass rates; a step whose groups
    were all dropped says so instead of a loss of 0). `step k/N` when the run's `total` steps are given; the
    loss is the mean over the steps since the previous line (`loss_mean`, else the step's own `loss`); the
    time since the run started (`elapsed_s`) and the estimated time left (`eta_s`)."""
    step = f"step {rec['step']:>6}" if total is None else f"step {rec['step']:>{len(str(total))}}/{total}"
    if "elapsed_s" in rec:
        step += f" | {clock(rec['elapsed_s'])}" + ("" if eta_s is None else f", ETA {clock(eta_s)}")
    mfu = "n/a" if rec.get("mfu") is None else f"{100 * rec['mfu']:.1f}%"
    if rec.get("rl/trained_tokens") == 0:  # loom rl: no answer to learn from, no gradient
        update = f"{_rl_dropped(rec)} | lr {rec['lr']:.2e}"
    else:
        loss = rec.get("loss_mean", rec["loss"])
        update = f"loss {loss:.4f} | lr {rec['lr']:.2e} | norm {rec['grad_norm']:.3f}"
    return (
        f"{step} | {update}{_rl_figures(rec)}"
        f" | dt {1000 * rec['dt']:.1f}ms (f {1000 * rec['dtf']:.0f} b {1000 * rec['dtb']:.0f})"
        f" | {rec['tokens_per_s']:,.0f} tok/s | mfu {mfu} | mem {rec['mem_bytes'] / 2**20:.0f}MiB"
        + (
            f" | scale {rec['loss_scale']:g} ({rec['overflow_steps']} overflow)"
            if "loss_scale" in rec
            else ""
        )
        + (f" | compile {rec['compile_s']:.1f}s" if "compile_s" in rec else "")
        + (  # loom dpo: the reward margin and the share of pairs ranked right
            f" | margin {rec['dpo/margin']:.3f} acc {rec['dpo/accuracy']:.2f}" if "dpo/margin" in rec else ""
        )
    )


def _rl_dropped(rec: dict) -> str:
    """Why a loom rl step trained nothing: its groups' rewards were all equal, or failed."""
    if "rl/groups" not in rec:  # a batch used again (rl.updates_per_batch): its rollout was reported before
        return "no gradient: every group of this batch's rollout was dropped"
    n, equal, failed = rec["rl/groups"], rec.get("rl/dropped_groups", 0), rec.get("rl/error_groups", 0)
    why = [f"{equal} with equal rewards"] if equal else []
    why += [f"{failed} with a failed reward"] if failed else []
    return f"no gradient: all {n} groups dropped ({', '.join(why) or 'no signal'})"


def _rl_figures(rec: dict) -> str:
    """loom rl: the rollout's mean reward and dropped groups, and the latest held-out pass rates."""
    out = ""
    if "rl/reward_mean" in rec:
        out += f" | reward {rec['rl/reward_mean']:.3f}"
        dropped = rec.get("rl/dropped_groups", 0) + rec.get("rl/error_groups", 0)
        if dropped and rec.get("rl/trained_tokens"):
            out += f" ({dropped}/{rec.get('rl/groups', '?')} groups dropped)"
    held = rec.get("rl/heldout")
    if held:
        rates = " ".join(f"{k} {v:.3f}" for k, v in held.items() if k.startswith("pass@"))
        out += f" | held-out {rates} (step {held['step']})"
    return out


# ------------------------------------------------------------------ trackers (the `track` extra)

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # config key -> package imported


def check_trackers(metrics_cfg) -> None:
    """Fail before any work when metrics.tensorboard / metrics.wandb is on but its package is missing."""
    import importlib.util

    from loom.errors import LoomError

    for key, package in TRACKERS.items():
        if getattr(metrics_cfg, key) and importlib.util.find_spec(package) is None:
            raise LoomError(
                f"metrics.{key}=true needs the '{package}' package, which is not installed",
                hint=f"pip install 'loom[track]' (or {package}), or set --metrics.{key}=false",
            )


def _scalars(record: dict) -> dict[str, float]:
    """Numeric fields of a record, named for dashboards: train/<key>, val/<key without val_>."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[f"val/{k.removeprefix('val_')}" if k.startswith("val_") else f"train/{k}"] = float(v)
    return out


class TensorBoardSink:
    """Event files under `log_dir` (torch.utils.tensorboard); one scalar per numeric field and step."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.step = 0

    def write(self, record: dict) -> None:
        if "summary" in record:  # the end-of-run figures, at the last step
            for k, v in record["summary"].items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.writer.add_scalar(f"summary/{k}", float(v), self.step)
            return
        self.step = int(record.get("step", self.step))
        for k, v in _scalars(record).items():
            self.writer.add_scalar(k, v, self.step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run; with WANDB_MODE=offline it writes under WANDB_DIR (or the run directory)."""

    def __init__(self, project: str, name: str, config: dict, run_dir: Path):
        import wandb

        self.run = wandb.init(
            project=project,
            name=name,
            config=config,
            dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            settings=wandb.Settings(console="off"),  # loom's own console output stays as it is
        )

    def write(self, record: dict) -> None:
        if "summary" in record:
            self.run.summary.update({k: v for k, v in record["summary"].items() if v is not None})
            return
        self.run.log(_scalars(record), step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """Every sink a run writes to (metrics.jsonl first); rank 0 only opens them."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def write(self, record: dict) -> None:
        for s in self.sinks:
            s.write(record)

    def mark_resumed(self, step: int) -> None:
        """metrics.jsonl alone gets `{"resumed_from": step}` (bookkeeping for read_jsonl, not a metric): the
        records of later steps before it are superseded by the steps this run trains again."""
        for s in self.sinks:
            if isinstance(s, JsonlSink):
                s.write({"resumed_from": step})

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def open_sinks(run_dir: Path, cfg) -> Sinks:
    """metrics.jsonl, plus TensorBoard and W&B when cfg.metrics asks (packages imported only then)."""
    m = cfg.metrics
    check_trackers(m)
    sinks: list = [JsonlSink(run_dir / "metrics.jsonl")]
    if m.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if m.wandb:
        sinks.append(WandbSink(m.wandb_project, run_dir.name, cfg.to_dict(), run_dir))
    return Sinks(sinks)


class StepTimer:
    """Forward ("f"), backward ("b") and explicit communication ("c": a gradient sync after backward, DiLoCo's
    outer step) time of a step, summed over its micro-batches: dtf, dtb, dtc; and `comm_exposed`.

    On a CPU the clock is read around each phase (the work is synchronous). On a GPU, device events are
    recorded on the stream instead (loom.device.Span), and read once when the step's record is made (after the
    step's one host read), so timing never makes the host wait inside a step; disabled, it records nothing."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled, self.device = enabled, device
        self.spans: dict[str, list] = {"f": [], "b": [], "c": []}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if not self.enabled:
            yield
            return
        span = dev.Span(self.device).start()
        yield
        self.spans[phase].append(span.stop())

    def read(self) -> dict:
        """{"dtf": s, "dtb": s, "dtc": s, "comm_exposed_s": s} (seconds), or {} when disabled."""
        if not self.enabled:
            return {}
        seconds = {k: [s.seconds() for s in v] for k, v in self.spans.items()}
        out = {f"dt{k}": float(sum(v)) for k, v in seconds.items()}
        out["comm_exposed_s"] = self.comm_exposed(seconds)
        return out

    @staticmethod
    def comm_exposed(seconds: dict[str, list[float]]) -> float:
        """Seconds of the step spent waiting on communication, not hidden behind compute: the explicit syncs
        ("c"), plus what the last backward (the one DDP all-reduces in; the others run under no_sync) took
        beyond the mean of the others. With one micro-batch a step has no backward without communication to
        compare with, and only the explicit part is counted."""
        b = seconds["b"]
        hidden = b[-1] - sum(b[:-1]) / (len(b) - 1) if len(b) > 1 else 0.0
        return float(sum(seconds["c"]) + max(hidden, 0.0))
