"""The verbs whose whole command lives in their own module: `loom launch`, `loom bench`, `loom doctor`,
`loom verify` (each imported only when called)."""

from __future__ import annotations

import sys


def launch(argv: list[str]) -> int:
    from loom.launch import launch_main

    return launch_main(argv)


def bench(argv: list[str]) -> int:
    benches = {
        "comm": "loom.bench.comm:comm_main",
        "optim": "loom.bench.optim:optim_main",
        "peak": "loom.bench.peak:peak_main",
        "train": "loom.bench.train:train_main",
        "generate": "loom.bench.generate:generate_main",
    }
    if not argv or argv[0] not in benches:
        print(
            f"usage: loom bench {{{','.join(benches)}}} [args]   (loom bench <name> --help)", file=sys.stderr
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    module, fn = benches[argv[0]].split(":")
    return getattr(importlib.import_module(module), fn)(argv[1:])


def doctor(argv: list[str]) -> int:
    from loom.doctor import doctor_main

    return doctor_main(argv)


def verify(argv: list[str]) -> int:
    from loom.verify import verify_main

    return verify_main(argv)
