"""Peak host memory (RSS) of `loom ckpt consolidate` against the size of the checkpoint's largest tensor.

    python benchmarks/consolidate_memory.py --run RUNS/NAME [--json out.json]
    python benchmarks/consolidate_memory.py --make --nproc 4 [--json out.json] -- --model.n_layer=2 ...

With --make, a run is trained for one step with `loom train --nproc N --parallel.dp_impl=fsdp` (the arguments
after -- are added) and checkpointed; then, in a fresh process that has already imported loom and torch,
the kernel's peak-RSS mark is reset (`5 > /proc/self/clear_refs`), consolidate runs, and its peak (VmHWM) is
read back. Reported: the resident size before (the constant: interpreter, torch, loom), the peak during, and
(peak - before) / largest tensor. Issue 16's bound: at most 1.5x the largest tensor plus a constant.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from loom import checkpoint_tools
from loom.parallel.dcp_state import saved_keys

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

run, out = Path(sys.argv[1]), Path(sys.argv[2])
step = max((run / "ckpt").glob("step_*"))
shapes = {k: s for k, s in saved_keys(step / "model").items() if s is not None}
largest = max(torch.Size(s).numel() for s in shapes.values()) * 4  # fp32 checkpoints
before = kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t0 = time.perf_counter()
checkpoint_tools.consolidate(run, out)
print(json.dumps({"rss_before": before, "peak_during": kib("VmHWM"), "largest_tensor": largest,
                  "params": sum(torch.Size(s).numel() for s in shapes.values()),
                  "out_bytes": (out / "model.safetensors").stat().st_size, "seconds": time.perf_counter() - t0}))
"""


def make_run(where: Path, nproc: int, extra: list[str]) -> Path:
    data = where / "data"
    src = Path(__file__).resolve().parents[1] / "src" / "loom"  # loom's own sources as the text
    subprocess.run(
        [sys.executable, "-m", "loom", "data", "prepare", "--input", str(src), "--out", str(data)],
        check=True,
        capture_output=True,
    )
    argv = [
        sys.executable,
        "-m",
        "loom",
        "train",
        f"--nproc={nproc}",
        "--parallel.dp_impl=fsdp",
        f"--data.path={data}",
        f"--run.dir={where}",
        "--run.name=c",
        "--train.steps=1",
        "--train.device=cpu",
        "--precision.dtype=fp32",
        "--train.eval_every=0",
        "--train.sample_every=0",
        *extra,
    ]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-3000:])
    return where / "c"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="an existing run directory with a sharded checkpoint")
    p.add_argument("--make", action="store_true", help="train a one-step fsdp run first (args after --)")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--json", default=None)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = (
            Path(args.run)
            if args.run
            else make_run(Path(tmp), args.nproc, [a for a in args.train_args if a != "--"])
        )
        r = subprocess.run(
            [sys.executable, "-c", CHILD, str(run), str(Path(tmp, "out"))], capture_output=True, text=True
        )
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        rec = json.loads(r.stdout.strip().splitlines()[-1])
    mib = lambda b: round(b / 2**20, 1)  # noqa: E731
    rec["extra_over_largest"] = round((rec["peak_during"] - rec["rss_before"]) / rec["largest_tensor"], 2)
    print(
        f"{rec['params'] / 1e6:.1f}M parameters, largest tensor {mib(rec['largest_tensor'])} MiB: RSS "
        f"{mib(rec['rss_before'])} MiB before, peak {mib(rec['peak_during'])} MiB during consolidate "
        f"({rec['seconds']:.1f} s): +{rec['extra_over_largest']}x the largest tensor"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, **rec}, indent=1))


if __name__ == "__main__":
    main()
