"""Peak RSS of the largest rank and the end-of-run sample's seconds of a 4-rank FSDP CPU run (issue 28 item 7).

    python benchmarks/fsdp_cpu_memory.py --data DIR [--tree PATH] [--name NAME]

Runs `loom train --nproc=4 --parallel.dp_impl=fsdp` on a 6x768 model (block 128, batch 8, 2 steps, the end-of-run
eval, a 200-token sample and the save) under `/usr/bin/time -v`, whose maximum resident set size is that of the
largest process (the largest rank). The sample's seconds are the time between the validation-loss line and the
sample's line. --tree runs another checkout's sources (its src/ first on PYTHONPATH): how the old and new trees
were compared, one after the other on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a prepared data directory (e.g. Tiny Shakespeare, char)")
    p.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1], help="a loom checkout")
    p.add_argument("--name", default="fsdp-memory", help="run name (under runs/bench)")
    args = p.parse_args()
    cmd = [
        "/usr/bin/time",
        "-v",
        sys.executable,
        "-m",
        "loom",
        "train",
        "--nproc=4",
        "--parallel.dp_impl=fsdp",
        "--model.n_layer=6",
        "--model.n_head=6",
        "--model.n_embd=768",
        "--model.block_size=128",
        "--train.batch_size=8",
        "--train.steps=2",
        "--train.eval_batches=1",
        "--train.eval_every=0",
        "--train.sample_tokens=200",
        "--train.log_every=1",
        "--train.device=cpu",
        f"--data.path={args.data}",
        "--run.dir=runs/bench",
        f"--run.name={args.name}",
        "--force",
    ]
    env = {**os.environ, "PYTHONPATH": str(args.tree / "src"), "PYTHONUNBUFFERED": "1"}
    t0, marks, out = time.perf_counter(), {}, []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        out.append(line)
        if "val loss" in line:
            marks.setdefault("eval", time.perf_counter() - t0)
        if "--- sample at step" in line:
            marks["sample"] = time.perf_counter() - t0
    proc.wait()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", "".join(out))
    if proc.returncode or not rss or len(marks) < 2:
        print("".join(out[-40:]))
        return 1
    print(
        f"{args.tree}: peak RSS of the largest rank {int(rss.group(1)) / 1e6:.2f} GB, end-of-run sample "
        f"{marks['sample'] - marks['eval']:.1f} s, whole run {time.perf_counter() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
