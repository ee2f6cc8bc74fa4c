"""`loom bench peak`: what this device really does — matmul FLOP/s per dtype and copy bandwidth (layer 6).

    loom bench peak [--device auto] [--dtypes fp32,bf16,fp16] [--sizes N,N,...] [--seconds 0.5]
                    [--json FILE]

Matmul: `loom.metrics.measure_matmul_flops` (best of repeated n x n matmuls, 2·n³ FLOPs each) at a few
sizes, the best kept; on GPUs it is compared with the dense datasheet peak of `GPU_PEAK_TFLOPS` (the
figure MFU divides by). Copy: `dst.copy_(src)` of a large buffer, 2 × bytes per copy (one read, one
write), median of repeats — the memory-bound ceiling that `loom bench optim` compares optimizers with.
On CPUs a copy also pays a write-allocate read of the destination, which in-place updates (an optimizer
step) do not, so those can exceed 100% of it there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loom import device as dev
from loom import log
from loom.errors import LoomError
from loom.metrics import DTYPES, _cpu_name, measure_matmul_flops, probe_flops

DEFAULT_SIZES = {"cpu": (512, 1024, 2048), "cuda": (2048, 4096, 8192)}


def resolve_device(name: str) -> torch.device:
    """`auto` → cuda when available, else cpu; `cuda` without a GPU is a LoomError."""
    if name == "auto":
        return torch.device("cuda" if dev.available("cuda") else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LoomError(f"--device '{name}' is not a device", hint="use auto, cpu or cuda") from None
    if device.type == "cuda" and not dev.available("cuda"):
        raise LoomError("--device cuda, but torch sees no CUDA device", hint="use --device cpu or auto")
    return device


def sync(device: torch.device) -> None:
    dev.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type != "cpu":
        return dev.name(device)
    n = torch.get_num_threads()
    return f"{_cpu_name()} ({n} thread{'' if n == 1 else 's'})"


def measure_copy_bandwidth(
    device: torch.device, nbytes: int | None = None, iters: int = 10
) -> dict[str, Any]:
    """Device copy bandwidth: 2 × bytes / median time of `dst.copy_(src)` (bytes read + bytes written)."""
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 2**28  # far beyond any cache
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages, kernel load
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"bytes": 4 * n, "time_s": t, "bandwidth_gbps": 2 * 4 * n / t / 1e9}


def datasheet_flops(device: torch.device, dtype: str) -> float | None:
    """The dense datasheet peak for a known GPU and dtype, else None."""
    tflops = dev.peak_tflops(device, dtype)
    return tflops * 1e12 if tflops is not None else None


def _supported(device: torch.device, dtype: str) -> str | None:
    """None when a matmul in `dtype` runs on `device`, else why not."""
    try:
        a = torch.ones(8, 8, dtype=DTYPES[dtype], device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as e:
        return str(e).splitlines()[0]
    return None


def bench_matmul(device: torch.device, dtype: str, sizes: list[int], seconds: float) -> dict[str, Any]:
    """Best matmul FLOP/s over `sizes` for one dtype, with the datasheet comparison on GPUs."""
    rec: dict[str, Any] = {"bench": "peak", "what": "matmul", "dtype": dtype, "device": device.type}
    why = _supported(device, dtype)
    if why is not None:
        return {**rec, "skipped": f"unsupported on {device.type}: {why}"}
    # A slow dtype (fp16 on most CPUs runs at a few GFLOP/s) would take minutes at large sizes:
    # measure_matmul_flops runs at least 6 matmuls, so sizes whose estimate exceeds the budget are left out.
    rate = probe_flops(device, DTYPES[dtype])
    affordable = affordable_sizes(sizes, rate, seconds)
    by_size = {n: measure_matmul_flops(device, dtype, n=n, seconds=seconds) for n in affordable}
    best = max(by_size, key=by_size.get)
    peak = datasheet_flops(device, dtype)
    rec.update(
        flops=by_size[best],
        size=best,
        by_size={str(n): f for n, f in by_size.items()},
        datasheet_flops=peak,
        fraction_of_datasheet=by_size[best] / peak if peak else None,
    )
    notes = []
    if len(affordable) < len(sizes):
        notes.append(
            f"sizes {sorted(set(sizes) - set(affordable))} left out: too slow at {rate / 1e9:.1f} GFLOP/s"
        )
    if device.type == "cpu" and (busy := busy_note(by_size[best], cached_cpu_peak(dtype))):
        notes.append(busy)
    if notes:
        rec["note"] = "; ".join(notes)
    return rec


def cached_cpu_peak(dtype: str) -> float | None:
    """The CPU peak loom.metrics.cpu_peak_flops cached for this machine, threads, torch and dtype (None when it
    has none: nothing is measured here)."""
    from loom.metrics import cpu_peak_key
    from loom.paths import cache_dir

    try:
        return float(json.loads((cache_dir() / "cpu_peak.json").read_text())[cpu_peak_key(dtype)])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def affordable_sizes(sizes: list[int], rate: float, seconds: float) -> list[int]:
    """The sizes whose measurement (at least 6 products of 2·n³ FLOPs at `rate` FLOP/s) fits the budget of
    max(2 s, 10 x seconds); the smallest at least."""
    budget = max(2.0, 10 * seconds)
    return [n for n in sorted(sizes) if 6 * 2 * n**3 / rate <= budget] or [min(sizes)]


def busy_note(measured: float, cached: float | None) -> str | None:
    """A CPU measurement far below the peak this machine reached before (the MFU cache keeps the best) was
    taken on a busy machine: said, with both figures, rather than shown as the machine's peak."""
    if cached is None or measured >= 0.5 * cached:
        return None
    return (
        f"{measured / 1e9:.1f} GFLOP/s is below half of the {cached / 1e9:.1f} GFLOP/s this CPU reached before "
        "(loom's MFU cache): other work was running; measure again on a quiet machine"
    )


def print_table(records: list[dict[str, Any]], title: str) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in ("what", "dtype", "measured", "at", "datasheet", "% of datasheet"):
        table.add_column(name, justify="left" if name in ("what", "dtype") else "right")
    for r in records:
        if "skipped" in r:
            table.add_row(r["what"], r.get("dtype", ""), "skipped", r["skipped"], "", "")
        elif r["what"] == "matmul":
            peak, frac = r["datasheet_flops"], r["fraction_of_datasheet"]
            table.add_row(
                "matmul",
                r["dtype"],
                f"{r['flops'] / 1e12:.3f} TFLOP/s",
                f"n={r['size']}",
                "n/a" if peak is None else f"{peak / 1e12:.0f} TFLOP/s",
                "n/a" if frac is None else f"{100 * frac:.1f}%",
            )
        else:
            table.add_row(
                "copy", "fp32", f"{r['bandwidth_gbps']:.1f} GB/s", f"{r['bytes'] / 2**20:.0f} MiB", "", ""
            )
    log.print_table(table)
    for r in records:
        if "note" in r:
            log.info(f"{r['what']} {r['dtype']}: {r['note']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom bench peak", description="Measured matmul FLOP/s per dtype and copy bandwidth."
    )
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu) | cpu | cuda | cuda:N"
    )
    p.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma list of fp32, bf16, fp16")
    p.add_argument(
        "--sizes",
        default=None,
        help="matrix sizes n (n x n @ n x n), comma list; best kept "
        "(default 512,1024,2048 on CPU, 2048,4096,8192 on CUDA)",
    )
    p.add_argument("--seconds", type=float, default=0.5, help="time per dtype and size (default 0.5)")
    p.add_argument(
        "--copy-mb", type=int, default=None, help="copy buffer in MiB (default 256 CPU, 1024 CUDA)"
    )
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    return p


def peak_main(argv: list[str]) -> int:
    """`loom bench peak`: matmul FLOP/s per dtype (best of a few sizes) and copy bandwidth, as a table."""
    args = _parser().parse_args(argv)
    if args.json:
        from loom.paths import check_output_file

        check_output_file(args.json, "--json")  # before the benchmark, not after it
    device = resolve_device(args.device)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise LoomError(f"unknown dtype {d!r}", hint=f"use one or more of {','.join(DTYPES)}")
    try:
        sizes = (
            [int(s) for s in args.sizes.split(",")]
            if args.sizes
            else list(DEFAULT_SIZES.get(device.type, (1024,)))
        )
    except ValueError as e:
        raise LoomError(f"cannot parse --sizes {args.sizes!r}", hint="write e.g. 1024,2048") from e
    if not sizes or min(sizes) < 1:
        raise LoomError(
            f"--sizes must be positive integers, got {args.sizes!r}", hint="e.g. --sizes 1024,2048"
        )
    if not args.seconds > 0:
        raise LoomError(f"--seconds must be > 0, got {args.seconds}", hint="e.g. --seconds 0.5")
    if args.copy_mb is not None and args.copy_mb < 1:
        raise LoomError(f"--copy-mb must be at least 1, got {args.copy_mb}")
    name = device_name(device)
    records = [bench_matmul(device, d, sizes, args.seconds) for d in dtypes]
    copy = measure_copy_bandwidth(device, None if args.copy_mb is None else args.copy_mb * 2**20)
    records.append({"bench": "peak", "what": "copy", "device": device.type, **copy})
    for r in records:
        r.update(device_name=name, torch_version=torch.__version__, threads=torch.get_num_threads())
    print_table(records, f"loom bench peak: {name}")
    if device.type == "cpu":
        log.info(
            "CPU: no datasheet peak; MFU on CPUs divides by this same measured matmul (cached per machine)"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
        log.info(f"wrote {args.json}")
    return 0
