"""`loom bench optim`: time one AdamW step per implementation on the parameters of a gpt2-family model (layer 6).

    loom bench optim [--params 124M] [--impls torch-fused,torch-foreach,torch-loop,triton]
                     [--iters 20] [--warmup 5] [--device auto] [--copy-mb N] [--json FILE]

The parameters are the tensors of loom's gpt2 family (built through the family registry on the meta device,
then allocated in fp32): OpenAI's gpt2 configurations for 124M / 350M / 774M / 1.5B, otherwise n_embd a
multiple of 64 with n_layer = n_embd / 64 (gpt2 small's aspect) and a vocabulary of at most 50257 and about a third of
the count. Each implementation is built through `loom.optim.build.build_optimizer` with loom's
decay / no-decay groups, so what is timed is what `optim.impl` trains with.

Time: median wall-clock of `--iters` steps after `--warmup`, each synchronised. Bandwidth: an AdamW step
reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq, so at least
7 × 4 bytes per fp32 parameter move; achieved bandwidth = 28 · N / time, shown beside the device's copy
bandwidth measured in the same run (`loom.bench.peak.measure_copy_bandwidth`), the ceiling for a
memory-bound kernel. Sizes: K, M, B (or G) are powers of 1000, as parameter counts are quoted.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loom import log
from loom.bench.peak import device_name, measure_copy_bandwidth, resolve_device, sync
from loom.config import Config, OptimConfig
from loom.errors import LoomError
from loom.model.flops import param_count
from loom.model.registry import get

IMPLS = ("torch-fused", "torch-foreach", "torch-loop", "triton")
BYTES_PER_PARAM = 7 * 4  # fp32: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
GPT2 = ((12, 768), (24, 1024), (36, 1280), (48, 1600))  # (n_layer, n_embd): 124M, 350M, 774M, 1.5B
_SCALE = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}


def parse_count(text: str) -> int:
    """`"124M"` → 124_000_000, `"1.5B"` → 1_500_000_000, `"350K"`, `"5000"` (K, M, B/G: powers of 1000)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]?)\s*", text)
    if m is None or m.group(2).upper() not in _SCALE or float(m.group(1)) * _SCALE[m.group(2).upper()] < 1:
        raise LoomError(f"cannot parse parameter count {text!r}", hint="write e.g. 10M, 124M, 1.5B or 350000")
    return round(float(m.group(1)) * _SCALE[m.group(2).upper()])


def _family_config(vocab_size: int, n_layer: int, n_embd: int):
    """The gpt2 family's model config for this shape (heads of 64, biases, a 1024-token context)."""
    cfg = Config()
    for key, value in dict(
        vocab_size=vocab_size,
        n_layer=n_layer,
        n_head=n_embd // 64,
        n_embd=n_embd,
        block_size=1024,
        bias=True,
    ).items():
        setattr(cfg.model, key, value)
    return get(cfg.model.family).config(cfg, vocab_size)  # the default family: gpt2


def gpt_config(n_params: int):
    """A gpt2-family model config with about `n_params` parameters: OpenAI's own within 5%, else one by the
    rule above."""
    for n_layer, n_embd in GPT2:
        cfg = _family_config(50257, n_layer, n_embd)
        if abs(param_count(cfg) - n_params) <= 0.05 * n_params:
            return cfg
    best = None
    for n_embd in range(64, 16385, 64):
        n_layer = max(1, round(n_embd / 64))
        vocab = min(50257, max(64, n_params // (3 * n_embd)))
        cfg = _family_config(vocab, n_layer, n_embd)
        err = abs(param_count(cfg) - n_params)
        if best is None or err < best[0]:
            best = (err, cfg)
        if param_count(cfg) > 2 * n_params:
            break
    return best[1]


def gpt_shapes(cfg) -> list[tuple[int, ...]]:
    """The shapes of the gpt2 family's distinct parameters (tied head once), without allocating them."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in get(Config().model.family).build(cfg).parameters()]


def bandwidth_gbps(n_params: int, seconds: float) -> float:
    """Achieved memory bandwidth of an AdamW step in GB/s (10^9 bytes): 28 bytes per fp32 parameter."""
    return BYTES_PER_PARAM * n_params / seconds / 1e9


def triton_skip_reason(device: torch.device) -> str | None:
    """Why TritonAdamW cannot be timed here, or None when it can."""
    from loom.optim.triton_adamw import check_device, interpreter_enabled

    try:
        interpret = interpreter_enabled()  # raises when triton is not installed
        if device.type == "cpu" and not interpret:
            return (
                "Triton has no CPU driver; TRITON_INTERPRET=1 would run the kernel in Triton's Python "
                "interpreter, which is correct but orders of magnitude too slow to benchmark"
            )
        check_device(device)
    except LoomError as e:
        return e.message + (f" ({e.hint})" if e.hint else "")
    if device.type == "cpu":
        log.warn("triton on CPU runs in Triton's interpreter: its time measures Python, not the kernel")
    return None


def time_impl(
    impl: str, params: list[torch.nn.Parameter], device: torch.device, iters: int, warmup: int
) -> dict:
    """Median / min step time of one implementation; each step synchronised with the device."""
    from loom.optim.build import build_optimizer

    opt = build_optimizer(torch.nn.ParameterList(params), OptimConfig(impl=impl, lr=1e-4), device)
    for _ in range(warmup):
        opt.step()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    rec = {"time_ms": 1e3 * statistics.median(times), "time_ms_min": 1e3 * min(times)}
    if hasattr(opt, "launches"):
        rec["launches_per_step"] = opt.launches / (warmup + iters)
    return rec


def run(
    n_params: int,
    impls: list[str],
    device: torch.device,
    iters: int,
    warmup: int,
    copy_bytes: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Benchmark `impls` on a gpt2-family parameter set of about n_params; one record per implementation.
    `progress`: a line as each measurement starts and ends (a 124M-parameter run takes minutes on a CPU)."""
    say = log.info if progress else (lambda _: None)
    cfg = gpt_config(n_params)
    shapes = gpt_shapes(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen))
        p.grad = torch.empty_like(p).normal_(0.0, 1e-2, generator=gen)  # no denormals in exp_avg_sq
        params.append(p)
    n = sum(p.numel() for p in params)
    say(f"{n / 1e6:.1f}M fp32 parameters on {device}: the copy bandwidth first, then {', '.join(impls)}")
    copy = measure_copy_bandwidth(device, copy_bytes)
    common = {
        "bench": "optim",
        "device": device.type,
        "device_name": device_name(device),
        "n_params": n,
        "n_tensors": len(params),
        "model": {
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "vocab_size": cfg.vocab_size,
            "block_size": cfg.block_size,
        },
        "iters": iters,
        "warmup": warmup,
        "bytes_per_step": BYTES_PER_PARAM * n,
        "copy_bandwidth_gbps": copy["bandwidth_gbps"],
        "copy_bytes": copy["bytes"],
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    records = []
    for impl in impls:
        why = triton_skip_reason(device) if impl == "triton" else None
        if why is not None:
            records.append({**common, "impl": impl, "skipped": why})
            continue
        say(f"{impl}: {warmup} warm-up + {iters} timed steps ...")
        rec = {**common, "impl": impl, **time_impl(impl, params, device, iters, warmup)}
        say(f"{impl}: {rec['time_ms']:.2f} ms a step (median)")
        rec["bandwidth_gbps"] = bandwidth_gbps(n, rec["time_ms"] / 1e3)
        rec["fraction_of_copy"] = rec["bandwidth_gbps"] / copy["bandwidth_gbps"]
        records.append(rec)
    fused = next((r for r in records if r["impl"] == "torch-fused" and "skipped" not in r), None)
    for r in records:
        if "skipped" not in r:
            r["speedup_vs_torch_fused"] = fused["time_ms"] / r["time_ms"] if fused else None
    return records


def print_table(records: list[dict[str, Any]]) -> None:
    from rich.table import Table

    first = records[0]
    m = first["model"]
    table = Table(
        title=f"loom bench optim: {first['n_params'] / 1e6:.1f}M fp32 params in {first['n_tensors']} "
        f"tensors (gpt2 n_layer={m['n_layer']} n_embd={m['n_embd']} vocab={m['vocab_size']}), "
        f"{first['device_name']}",
        title_justify="left",
    )
    for name in ("impl", "median ms", "min ms", "GB/s", "% of copy", "vs fused"):
        table.add_column(name, justify="left" if name == "impl" else "right")
    for r in records:
        if "skipped" in r:
            table.add_row(r["impl"], "skipped", "", "", "", "")
            continue
        ratio = r["speedup_vs_torch_fused"]
        table.add_row(
            r["impl"],
            f"{r['time_ms']:.2f}",
            f"{r['time_ms_min']:.2f}",
            f"{r['bandwidth_gbps']:.1f}",
            f"{100 * r['fraction_of_copy']:.0f}%",
            "n/a" if ratio is None else f"{ratio:.2f}x",
        )
    log.print_table(table)
    log.info(
        f"bytes per step: 28 x {first['n_params']:,} = {first['bytes_per_step'] / 1e9:.3f} GB; copy bandwidth "
        f"{first['copy_bandwidth_gbps']:.1f} GB/s (2 x {first['copy_bytes'] / 2**20:.0f} MiB / median time); "
        "'vs fused' = torch-fused time / this time (> 1 is faster)"
    )
    for r in records:
        if "skipped" in r:
            log.info(f"{r['impl']} skipped: {r['skipped']}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom bench optim", description="Time an AdamW step per implementation.")
    p.add_argument("--params", default="124M", help="parameter count: 10M, 124M, 1.5B, ... (default 124M)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)} (default all)")
    p.add_argument("--iters", type=int, default=20, help="timed steps per implementation (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument(
        "--device", default="auto", help="auto (cuda if available, else cpu) | cpu | cuda | cuda:N"
    )
    p.add_argument(
        "--copy-mb", type=int, default=None, help="copy-bandwidth buffer in MiB (default 256 CPU, 1024 CUDA)"
    )
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--quiet", action="store_true", help="print nothing (--json is still written)")
    return p


def optim_main(argv: list[str]) -> int:
    """`loom bench optim`: parse, build the parameters once, time each implementation, report."""
    args = _parser().parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise LoomError(
            f"--iters must be ≥ 1 and --warmup ≥ 0; got --iters {args.iters} --warmup {args.warmup}",
            hint="e.g. --iters 20 --warmup 5",
        )
    if args.json:
        from loom.paths import check_output_file

        check_output_file(args.json, "--json")  # before the benchmark, not after it
    impls = list(dict.fromkeys(t.strip() for t in args.impls.split(",") if t.strip()))
    for impl in impls:
        if impl not in IMPLS:
            raise LoomError(f"unknown implementation {impl!r}", hint=f"use one or more of {','.join(IMPLS)}")
    if not impls:
        raise LoomError("no implementation given", hint=f"use one or more of {','.join(IMPLS)}")
    if args.copy_mb is not None and args.copy_mb < 1:
        raise LoomError(f"--copy-mb must be at least 1, got {args.copy_mb}")
    device = resolve_device(args.device)
    copy_bytes = None if args.copy_mb is None else args.copy_mb * 2**20
    records = run(
        parse_count(args.params), impls, device, args.iters, args.warmup, copy_bytes, progress=not args.quiet
    )
    if not args.quiet:
        print_table(records)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
        if not args.quiet:
            log.info(f"wrote {args.json}")
    return 0
