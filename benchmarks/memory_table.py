"""Bytes of model state each rank holds: dp=1 (one process) against dp=4 ddp / zero1 / zero2 / fsdp, on a
~10.7M-parameter GPT (6 layers, 384 wide), fp32 AdamW. Reads the mem_* fields loom writes to metrics.jsonl.

    python benchmarks/memory_table.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from loom.data.corpus import python_stdlib_files
from loom.data.prepare import prepare
from loom.metrics import read_jsonl

MODEL = ["--model.n_layer=6", "--model.n_head=6", "--model.n_embd=384", "--model.block_size=256"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="loom-mem-"))
    prepare(python_stdlib_files()[:20], tmp / "data", tokenizer="char", seed=0)
    common = [
        f"--data.path={tmp / 'data'}",
        f"--run.dir={tmp}",
        *MODEL,
        "--train.steps=2",
        "--train.batch_size=4",
        "--train.log_every=1",
        "--train.eval_every=0",
        "--train.sample_every=0",
        "--train.ckpt_every=0",
        "--train.eval_batches=1",
        "--train.device=cpu",
    ]
    rows = {}
    for name, extra in [("dp=1", ["--parallel.dp_impl=none"])] + [
        (f"dp=4 {k}", ["--nproc=4", f"--parallel.dp_impl={k}"]) for k in ("ddp", "zero1", "zero2", "fsdp")
    ]:
        run = name.replace(" ", "-").replace("=", "")
        r = subprocess.run(
            [sys.executable, "-m", "loom", "train", f"--run.name={run}", *common, *extra],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        rec = [x for x in read_jsonl(tmp / run / "metrics.jsonl") if "mem_params" in x][-1]
        rows[name] = {k: rec[f"mem_{k}"] for k in ("params", "grads", "optim")} | {"peak": rec["mem_bytes"]}
    base = rows["dp=1"]
    print(
        f"{'run':<12} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'state/dp=1':>11} {'peak RSS MiB':>13}"
    )
    for name, m in rows.items():
        state = (m["params"] + m["grads"] + m["optim"]) / (base["params"] + base["grads"] + base["optim"])
        print(
            f"{name:<12} {m['params'] / 2**20:>11.2f} {m['grads'] / 2**20:>10.2f} {m['optim'] / 2**20:>10.2f}"
            f" {state:>11.3f} {m['peak'] / 2**20:>13.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
