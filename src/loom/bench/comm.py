"""`loom bench comm`: bandwidth of collectives on torch.distributed, MPI and loom's own ring (layer 6).

    loom bench comm [--backend torch,mpi,ring] [--ops all_reduce,all_gather,reduce_scatter,broadcast]
                    [--sizes 1KB..256MB] [--iters 20] [--warmup 5] [--dtype fp32]
                    [--nproc N] [--json FILE] [--plot FILE.png]

Run it inside a job (`mpiexec -n N loom bench comm ...`, `torchrun --nproc-per-node N ...`) or let it
start one with `--nproc N`: one local job per backend, torch's elastic launcher for `torch`, mpiexec
for `mpi` and `ring`; the parent merges their results and reports them. Rank 0 prints a table of
time, algbw and busbw (nccl-tests' definitions, see `comm_backends`), and writes --json / --plot.
Sizes: KB / MB / GB mean 2^10 / 2^20 / 2^30 bytes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loom import log
from loom.bench.comm_backends import bench, mpi_comm, require_mpi, torch_comm
from loom.env import detect_env, free_port
from loom.errors import LoomError

BACKENDS = ("torch", "mpi", "ring")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "M": 2**20, "MB": 2**20, "G": 2**30, "GB": 2**30}


# ------------------------------------------------------------------------------------- pure helpers


def parse_size(text: str) -> int:
    """`"64MB"` → 67108864: an integer with an optional unit B, KB, MB, GB (K, M, G; any case), 2^10 based."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS or int(m.group(1)) == 0:
        raise LoomError(f"cannot parse size {text!r}", hint="write e.g. 4096, 1KB, 64MB or 1GB")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """`"1KB..1MB"` → powers of two 1 KB, 2 KB, ... 1 MB; `"1KB,64MB"` → a list; mixed items allowed.

    A range doubles from its start while ≤ its end (nccl-tests' `-b 1K -e 1M -f 2`). Sorted, unique.
    """
    sizes: set[int] = set()
    for item in filter(str.strip, text.split(",")):
        if ".." not in item:
            sizes.add(parse_size(item))
            continue
        lo_text, hi_text = item.split("..", 1)
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if hi < lo:
            raise LoomError(
                f"size range {item!r} runs backwards", hint="write the smaller size first: 1KB..64MB"
            )
        while lo <= hi:
            sizes.add(lo)
            lo *= 2
    if not sizes:
        raise LoomError(f"no sizes in {text!r}", hint="write e.g. 1KB..64MB or 1KB,1MB")
    return sorted(sizes)


def parse_choices(text: str, choices: tuple[str, ...], what: str) -> list[str]:
    """A comma list of names from `choices`, in the given order, without repeats; "all" means every one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(choices)
    for name in names:
        if name not in choices:
            raise LoomError(f"unknown {what} {name!r}", hint=f"use one or more of {','.join(choices)}")
    if not names:
        raise LoomError(f"no {what} given", hint=f"use one or more of {','.join(choices)}")
    return list(dict.fromkeys(names))


def format_bytes(n: int) -> str:
    """1024 → "1 KB"; sizes that are not a whole number of units stay in bytes."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------------------- output


def print_table(records: list[dict[str, Any]]) -> None:
    """The results as a rich table on rank 0's console."""
    from rich.table import Table

    first = records[0] if records else {"world_size": "?", "dtype": "?"}
    table = Table(
        title=f"loom bench comm: {first['world_size']} ranks, {first['dtype']}", title_justify="left"
    )
    for name in ("backend", "op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(name, justify="left" if name in ("backend", "op") else "right")
    for r in records:
        table.add_row(
            r["backend"],
            r["op"],
            format_bytes(r["bytes"]),
            f"{r['time_us']:.1f}",
            f"{r['algbw_gbps']:.3f}",
            f"{r['busbw_gbps']:.3f}",
        )
    log.print_table(table)


def plot(records: list[dict[str, Any]], path: str | Path) -> None:
    """busbw against size, log-log: one panel per op, one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    ops = list(dict.fromkeys(r["op"] for r in records)) or ["none"]
    backends = list(dict.fromkeys(r["backend"] for r in records))
    # at most 6 labelled powers of two on the size axis
    exps = sorted({r["bytes"].bit_length() - 1 for r in records}) or [10]
    stride = max(1, -(-(exps[-1] - exps[0]) // 5))
    ticks = [2**e for e in range(exps[0], exps[-1] + 1, stride)]
    ncols = min(2, len(ops))
    nrows = -(-len(ops) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(ops):
            ax.set_visible(False)
            continue
        for backend in backends:
            pts = sorted(
                (r["bytes"], r["busbw_gbps"])
                for r in records
                if r["op"] == ops[i] and r["backend"] == backend and r["busbw_gbps"] > 0
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ticks, [format_bytes(t) for t in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set(title=ops[i], xlabel="size", ylabel="busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        if backends:
            ax.legend()
    if records:
        fig.suptitle(f"{records[0]['world_size']} ranks, {records[0]['dtype']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Table, --json and --plot (call on rank 0 only)."""
    if not args.quiet:
        print_table(records)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(records, args.plot)
    if (args.json or args.plot) and not args.quiet:
        log.info("wrote " + " and ".join(str(p) for p in (args.json, args.plot) if p))


# ---------------------------------------------------------------------------------------- launching


def _in_this_job(args: argparse.Namespace, backends: list[str], ops: list[str], sizes: list[int]) -> int:
    """Run every backend in the job this process belongs to (mpiexec, torchrun, or --nproc's child)."""
    env = detect_env()
    log.setup(rank=env.rank)
    if env.source == "torchrun" and set(backends) - {"torch"}:
        raise LoomError(
            "--backend mpi / ring need MPI ranks, but this job was started by torchrun",
            hint="run it under mpiexec -n N, or with --nproc N",
        )
    if "torch" in backends and env.source in ("none", "pbs"):  # no launcher started this process
        raise LoomError(
            "--backend torch needs a job of several processes, and this is one process",
            hint="add --nproc 2 (or run under torchrun --nproc-per-node 2 / mpiexec -n 2)",
        )
    records = []
    for backend in backends:
        comm = torch_comm(args.dtype, args.device) if backend == "torch" else mpi_comm(backend, args.dtype)
        if comm.world_size == 1:
            log.warn_once(
                "world size 1: nothing is communicated and busbw is 0; use mpiexec -n N or --nproc N"
            )
        records += bench(comm, backend, ops, sizes, args.dtype, args.iters, args.warmup)
        comm.close()
    if comm.rank == 0:
        report(records, args)
    return 0


def _run_mpiexec(nproc: int, child: list[str]) -> str | None:
    """Run `child` on nproc MPI ranks; None on success, else what failed."""
    from loom.launch.commands import local_mpiexec

    code = subprocess.run(local_mpiexec(child, nproc)).returncode
    return None if code == 0 else f"mpiexec exited with code {code}"


def _run_elastic(nproc: int, child: list[str]) -> str | None:
    """Run `child` in nproc processes under torch's elastic agent; None on success, else what failed."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"loom-bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        monitor_interval=0.2,
    )
    logging.getLogger("torch.distributed.elastic").setLevel(
        logging.CRITICAL
    )  # failures are reported below, once
    try:
        elastic_launch(config, child[0])(*child[1:])
    except ChildFailedError as e:
        failed = ", ".join(f"rank {rank} (exit code {f.exitcode})" for rank, f in sorted(e.failures.items()))
        return f"failed: {failed}"
    return None


def _launch_local(args: argparse.Namespace, backends: list[str], ops: list[str], sizes: list[int]) -> int:
    """--nproc N: one local job of N processes per backend; merge their records here and report."""
    if args.nproc < 1:
        raise LoomError(f"--nproc must be at least 1, got {args.nproc}")
    from loom.env import oversubscription

    if warning := oversubscription(args.nproc):
        log.warn(warning)
    if detect_env().world_size > 1:
        raise LoomError(
            "--nproc inside a job that is already distributed",
            hint="drop --nproc under mpiexec / torchrun / srun",
        )
    if set(backends) - {"torch"} and importlib.util.find_spec("mpi4py") is None:
        require_mpi()  # raises the LoomError that names loom[mpi]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    log.info(f"starting {args.nproc} processes per backend: {', '.join(backends)}")
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="loom-bench-comm-") as tmp:
        for backend in backends:
            out = Path(tmp) / f"{backend}.json"
            child = [
                sys.executable,
                "-m",
                "loom.bench.comm",
                "--backend",
                backend,
                "--ops",
                ",".join(ops),
                "--sizes",
                ",".join(map(str, sizes)),
                "--iters",
                str(args.iters),
                "--warmup",
                str(args.warmup),
                "--dtype",
                args.dtype_name,
                "--device",
                args.device,
                "--json",
                str(out),
                "--quiet",
            ]
            failed = (
                _run_elastic(args.nproc, child) if backend == "torch" else _run_mpiexec(args.nproc, child)
            )
            if failed or not out.is_file():
                log.error(
                    f"loom: error: the {backend} benchmark job {failed or 'wrote no results'} (output above)"
                )
                return 1
            records += json.loads(out.read_text(encoding="utf-8"))
    report(records, args)
    return 0


# -------------------------------------------------------------------------------------------- entry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom bench comm",
        description="Time collectives (nccl-tests' algbw / busbw) on torch.distributed, MPI and loom's ring.",
        epilog="Run under mpiexec -n N / torchrun, or start a local job with --nproc N.",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="comma list of torch, mpi, ring (default: all three; torch only under torchrun)",
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)} (default all)")
    p.add_argument(
        "--sizes",
        default="1KB..256MB",
        help="FROM..TO in powers of 2, or a comma list; B, KB, MB, GB (default 1KB..256MB)",
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls per op and size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="element type (default fp32)")
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="torch backend only: auto = CUDA (NCCL) when available, else CPU (gloo)",
    )
    p.add_argument("--nproc", type=int, default=None, help="start N local processes per backend")
    p.add_argument("--json", metavar="FILE", help="write the records as a JSON list")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw against size (log-log)")
    p.add_argument("--quiet", action="store_true", help="print nothing (--json and --plot are still written)")
    return p


def comm_main(argv: list[str]) -> int:
    """`loom bench comm`: parse, check everything once, then benchmark here or start local jobs."""
    args = _parser().parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        raise LoomError(
            f"--iters must be ≥ 1 and --warmup ≥ 0; got --iters {args.iters} --warmup {args.warmup}",
            hint="e.g. --iters 20 --warmup 5",
        )
    from loom.paths import check_output_file

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(path, flag)  # before the benchmark, not after it
    args.dtype_name, args.dtype = args.dtype, DTYPES[args.dtype]
    ops, sizes = parse_choices(args.ops, OPS, "op"), parse_sizes(args.sizes)
    if args.backend is not None:
        if args.backend.strip().lower() in ("nccl", "gloo"):
            raise LoomError(
                f"{args.backend} is not a backend here: torch.distributed picks it",
                hint="use --backend torch (gloo on CPU, NCCL on CUDA; --device chooses)",
            )
        backends = parse_choices(args.backend, BACKENDS, "backend")
    elif args.nproc is None and detect_env().source == "torchrun":
        backends = ["torch"]
    elif importlib.util.find_spec("mpi4py") is None:
        log.warn(
            "mpi4py is not installed, so only --backend torch runs (pip install 'loom[mpi]' for mpi, ring)"
        )
        backends = ["torch"]
    else:
        backends = list(BACKENDS)
    if args.dtype == "bfloat16" and set(backends) - {"torch"}:
        raise LoomError(
            "bf16 is only supported by --backend torch", hint="use --dtype fp32 or fp16 for mpi / ring"
        )
    if args.nproc is not None:
        return _launch_local(args, backends, ops, sizes)
    return _in_this_job(args, backends, ops, sizes)


if __name__ == "__main__":  # the children of --nproc, and a way to run it before the CLI verb exists
    try:
        sys.exit(comm_main(sys.argv[1:]))
    except LoomError as e:
        print(f"loom: error: {e}", file=sys.stderr)
        sys.exit(2)
