"""The verbs whose whole command lives in their own module: `loom launch`, `loom bench`, `loom doctor`,
`loom verify` (each imported only when called)."""

from __future__ import annotations

import sys


def launch(argv: list[str]) -> int:
    from loom.launch import launch_main

    return launch_main(argv)


# each benchmark: (its entry point, what it measures: the line `loom bench --help` shows)
BENCHES = {
    "comm": (
        "loom.bench.comm:comm_main",
        "bandwidth of collectives between processes (torch.distributed, MPI, loom's ring)",
    ),
    "optim": (
        "loom.bench.optim:optim_main",
        "one AdamW step's time per implementation, on a model's parameters",
    ),
    "peak": (
        "loom.bench.peak:peak_main",
        "matmul FLOP/s per dtype and copy bandwidth this device really reaches (MFU's peak)",
    ),
    "train": (
        "loom.bench.train:train_main",
        "training throughput of a config: tokens/s, tokens/s per device, MFU, memory",
    ),
    "generate": (
        "loom.bench.generate:generate_main",
        "generation tokens/s of loom's engine beside transformers', and under concurrent clients",
    ),
}


def bench_usage() -> str:
    """`loom bench --help`: the usage line and one line per benchmark."""
    lines = [
        f"usage: loom bench {{{','.join(BENCHES)}}} [args]   (loom bench <name> --help for its options)",
        "",
    ]
    lines += [f"  {name:<9} {doc}" for name, (_, doc) in BENCHES.items()]
    return "\n".join(lines)


def bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(bench_usage(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    import importlib

    module, fn = BENCHES[argv[0]][0].split(":")
    return getattr(importlib.import_module(module), fn)(argv[1:])


def doctor(argv: list[str]) -> int:
    from loom.doctor import doctor_main

    return doctor_main(argv)


def verify(argv: list[str]) -> int:
    from loom.verify import verify_main

    return verify_main(argv)
