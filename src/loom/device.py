"""Every device-specific call of loom, keyed by device type (layer 0): cuda, xpu, mps, cpu.

loom's other modules never name `torch.cuda` (or `torch.xpu`, `torch.mps`); they ask this module for what they
want of "the accelerator": synchronise, time a span on its stream, read and reset its memory peaks, empty its
cache, pin host memory, record and dump its allocation history, its name, capability, random state and peak
FLOP/s, the collective backend it pairs with. `tests/unit/test_device_calls.py` greps `src/` for device calls
outside this module (and `compat.py`, where the private ones live).

What each device type gives (a missing entry is "nothing to do" or "unknown", never a guess):
  * cuda: all of it; the memory history is PyTorch's `_record_memory_history` (through loom.compat).
  * xpu (Intel, torch >= 2.4's `torch.xpu`): synchronize, events, memory stats and peaks, empty_cache, rng,
    set_device, the `xccl` backend and its peaks in `PEAK_TFLOPS`; no memory history (none in torch.xpu).
  * mps (Apple): synchronize, current allocated memory (no peak counter: the current value stands in),
    empty_cache, rng; no events of its own here (host clocks after a synchronize), no peak table.
  * cpu: nothing to synchronise; memory is the process's peak resident set size; the peak FLOP/s is measured
    (loom.metrics.cpu_peak_flops), not tabled.
Adding a device type is a row in each table below and a branch in `_module`, not a search through the code.
torch is imported inside each function: this module sits below everything (as compat.py does).
"""

from __future__ import annotations

import contextlib
import platform
import resource
import time

# Dense peak TFLOP/s by device type, then (device-name substring, dtype); first match wins, so a longer name
# comes before its prefix ("H100 PCIe" before "H100"). fp32 here means fp32 matmul without TF32; fp8 where the
# GPU has float8 tensor cores (compute capability >= 8.9). An fp8 run's MFU is still reported against the bf16
# peak, as torchtitan and nanochat do: the fp8 peak is printed beside it.
PEAK_TFLOPS: dict[str, dict[str, dict[str, float]]] = {
    "cuda": {
        "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
        "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0, "fp8": 1513.0},
        "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
        "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
        "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
        "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6, "fp8": 733.0},
        "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3, "fp8": 242.0},
        "V100": {"fp16": 125.0, "fp32": 15.7},
        "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6, "fp8": 330.0},
        "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "fp32": 35.6},
    },
    # Intel Data Center GPU Max 1550 (Aurora, ALCF): XMX dense bf16/fp16, fp32 vector
    "xpu": {"Max 1550": {"bf16": 838.9, "fp16": 838.9, "fp32": 52.4}},
}

# the process-group backend each accelerator pairs with (gloo carries CPU tensors on every one)
DIST_BACKEND = {"cuda": "nccl", "xpu": "xccl"}

# device types whose kernels run asynchronously on a stream (a host clock needs a synchronize)
ASYNC = ("cuda", "xpu", "mps")


def _module(kind: str):
    """torch's module for an accelerator type (torch.cuda, torch.xpu, torch.mps), or None for the CPU."""
    import torch

    return {"cuda": torch.cuda, "xpu": getattr(torch, "xpu", None), "mps": getattr(torch, "mps", None)}.get(
        kind
    )


def available(kind: str) -> bool:
    """Whether this machine has a device of this type."""
    mod = _module(kind)
    if kind == "mps":
        import torch

        return torch.backends.mps.is_available()
    return mod is not None and mod.is_available()


def count(kind: str) -> int:
    """How many devices of this type this machine has (mps: one at most)."""
    if not available(kind):
        return 0
    return 1 if kind == "mps" else _module(kind).device_count()


def default_type() -> str:
    """The accelerator this machine has (cuda, then xpu), else "cpu" (mps is asked for by name)."""
    return next((k for k in ("cuda", "xpu") if available(k)), "cpu")


def synchronize(device) -> None:
    """Wait for the device's queued work (nothing on a CPU)."""
    mod = _module(device.type)
    if mod is not None:
        mod.synchronize(device) if device.type != "mps" else mod.synchronize()


def set_device(device) -> None:
    """Make `device` this process's current one (a CUDA or XPU rank's own GPU)."""
    if device.type in ("cuda", "xpu"):
        _module(device.type).set_device(device)


def current_stream(device):
    """The device's current stream (None on a CPU or MPS)."""
    if device.type in ("cuda", "xpu"):
        return _module(device.type).current_stream(device)
    return None


def on_device(device):
    """A context that makes `device` current while it runs (a kernel launch on another GPU than the default)."""
    if device.type in ("cuda", "xpu"):
        return _module(device.type).device(device)
    return contextlib.nullcontext()


class Span:
    """A timed span on the device's stream: events where the device has them (read later, no host wait inside
    a step), the host clock otherwise (or with `host`: a wait of the host itself). `start()`, `stop()`, then
    `done()` (whether the device has reached its end, without waiting) and `seconds()` (which may wait)."""

    def __init__(self, device, host: bool = False):
        self.events = device.type in ("cuda", "xpu") and not host
        self.mod = _module(device.type)

    def start(self) -> Span:
        if self.events:
            self.a, self.b = self.mod.Event(enable_timing=True), self.mod.Event(enable_timing=True)
            self.a.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def stop(self) -> Span:
        if self.events:
            self.b.record()
        else:
            self.dt = time.perf_counter() - self.t0
        return self

    def done(self) -> bool:
        return self.b.query() if self.events else True

    def seconds(self) -> float:
        return self.a.elapsed_time(self.b) / 1000 if self.events else self.dt


def name(device) -> str:
    """The device's marketing name ("NVIDIA H100 80GB HBM3"); "" for a CPU or a type without one."""
    if device.type in ("cuda", "xpu"):
        return _module(device.type).get_device_name(device)
    return ""


def capability(device) -> tuple[int, int] | None:
    """CUDA's compute capability (major, minor); None elsewhere."""
    if device.type == "cuda":
        return _module("cuda").get_device_capability(device)
    return None


def has_bf16(device) -> bool:
    """This accelerator computes in bf16 (CUDA asks the GPU; an Intel GPU always does; MPS and CPUs: no)."""
    if device.type == "cuda":
        return _module("cuda").is_bf16_supported()
    return device.type == "xpu"


def lacks_bf16(device) -> bool:
    """A GPU without bf16 (a config asking for it is refused); CPUs emulate it, other types are not checked."""
    return device.type == "cuda" and not has_bf16(device)


def peak_tflops(device, dtype: str) -> float | None:
    """The datasheet peak TFLOP/s of this device for dtype, or None when the table does not know it."""
    table = PEAK_TFLOPS.get(device.type)
    if not table:
        return None
    full = name(device)
    return next((p[dtype] for key, p in table.items() if key in full and dtype in p), None)


def dist_backend(device) -> str:
    """init_process_group's backend: gloo for CPU tensors, plus the accelerator's own ("cpu:gloo,cuda:nccl")."""
    own = DIST_BACKEND.get(device.type)
    return f"cpu:gloo,{device.type}:{own}" if own else "gloo"


def set_tf32(device, on: bool) -> None:
    """TF32 (fp32 matmuls on tensor cores, a 10-bit mantissa) on or off; a CUDA setting."""
    if device.type == "cuda":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = on
        torch.backends.cudnn.allow_tf32 = on


def profiler_activities(device) -> list:
    """torch.profiler's activities for a run on this device: the CPU's, and the accelerator's kernels."""
    from torch.profiler import ProfilerActivity

    own = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS"}.get(device.type)
    return [ProfilerActivity.CPU] + (
        [getattr(ProfilerActivity, own)] if hasattr(ProfilerActivity, own or "") else []
    )


# --- memory ------------------------------------------------------------------------------------------------


def _host_peak_rss() -> int:
    """The process's peak resident set: Linux's VmHWM, which is never below a VmRSS read before it (getrusage's
    maxrss can be, by a few pages: the kernel's per-CPU counters are approximate); elsewhere getrusage."""
    try:
        for line in open("/proc/self/status", encoding="ascii"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if platform.system() == "Darwin" else rss * 1024)


def peak_memory(device) -> int:
    """Peak allocated device memory (since the last `reset_peak`); on a CPU the process's peak resident set
    size (never reset); on MPS the current allocation (MPS keeps no peak)."""
    if device.type in ("cuda", "xpu"):
        return int(_module(device.type).max_memory_allocated(device))
    if device.type == "mps":
        return int(_module("mps").current_allocated_memory())
    return _host_peak_rss()


def reset_peak(device) -> None:
    """Start the peak counter again (CUDA, XPU); a CPU's resident-set peak cannot be reset."""
    if device.type in ("cuda", "xpu"):
        _module(device.type).reset_peak_memory_stats(device)


def empty_cache(device) -> None:
    """Give the caching allocator's free blocks back to the device."""
    mod = _module(device.type)
    if mod is not None:
        mod.empty_cache()


def can_pin() -> bool:
    """Whether host memory can be page-locked (an accelerator to copy to must exist)."""
    return available("cuda") or available("xpu")


def get_rng_state(device):
    """The device's random generator state (None on a CPU: torch's CPU state is saved apart)."""
    mod = _module(device.type)
    if mod is None:
        return None
    return mod.get_rng_state(device) if device.type != "mps" else mod.get_rng_state()


def set_rng_state(device, state) -> None:
    mod = _module(device.type)
    if mod is not None:
        mod.set_rng_state(state, device) if device.type != "mps" else mod.set_rng_state(state)


def memory_history(device, on: bool) -> bool:
    """Record (or stop recording) the device's allocation history; False where the device has none (CUDA
    only in torch 2.13: XPU, MPS and CPU keep no history)."""
    if device.type != "cuda":
        return False
    from loom import compat

    compat.record_memory_history(on)
    return True


def dump_memory_history(device, path) -> None:
    """The recorded history as a pickle for pytorch.org/memory_viz (after `memory_history(device, True)`)."""
    from loom import compat

    compat.dump_memory_snapshot(str(path))
