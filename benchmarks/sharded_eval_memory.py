"""Peak memory per process of `loom eval` with the whole model in one process vs `--shard` over N processes.

    python benchmarks/sharded_eval_memory.py [--layers 24 --width 768] [--nproc 2 4] [--json FILE]

Trains a model of --layers x --width for one step (one checkpoint), and a 1-layer, 16-wide one for the
constant (interpreter, torch, loom); then measures each eval's peak RSS with /usr/bin/time (every process of a
torchrun job, which wraps each rank). Reported: the peak per process and the part above the constant, also
as a fraction of the model's weights (fp32). CPU, gloo: the sharded ranks all-gather one block at a time.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIME = ["/usr/bin/time", "-f", "peak_rss_kib %M"]


def train(runs: Path, name: str, layers: int, width: int, heads: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "loom",
        "train",
        "--data.path=data/shakespeare_char",
        f"--run.dir={runs}",
        f"--run.name={name}",
        f"--model.n_layer={layers}",
        f"--model.n_embd={width}",
        f"--model.n_head={heads}",
        "--model.block_size=64",
        "--train.batch_size=4",
        "--train.steps=1",
        "--train.eval_batches=1",
        "--train.sample_every=0",
        "--train.sample_tokens=1",
        "--train.device=cpu",
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)


def peaks(cmd: list[str]) -> tuple[list[float], str]:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(r.stdout[-2000:] + r.stderr[-3000:])
    found = [int(k) / 1024 for k in re.findall(r"peak_rss_kib (\d+)", r.stdout + r.stderr)]
    loss = re.search(r"val loss ([0-9.]+)", r.stdout)
    return found, loss.group(1) if loss else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eval_args = ["-m", "loom", "eval", "--device", "cpu", "--batches", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        train(runs, "tiny", 1, 16, 1)
        train(runs, "model", args.layers, args.width, max(1, args.width // 64))
        weights = (
            sum(p.stat().st_size for p in (runs / "model" / "ckpt").glob("step_*/model/*.distcp")) / 2**20
        )
        const = peaks([*TIME, sys.executable, *eval_args, str(runs / "tiny")])[0][0]
        whole, loss = peaks([*TIME, sys.executable, *eval_args, str(runs / "model")])
        res = {
            "model_weights_mib": round(weights, 1),
            "constant_mib": round(const, 1),
            "whole": {
                "peak_mib": round(whole[0], 1),
                "above_constant_x_weights": round((whole[0] - const) / weights, 3),
                "val_loss": loss,
            },
        }
        torchrun = str(Path(sys.executable).parent / "torchrun")
        for n in args.nproc:
            got, loss_n = peaks(
                [
                    torchrun,
                    "--nproc-per-node",
                    str(n),
                    "--master-port",
                    str(29700 + n),
                    "--no-python",
                    *TIME,
                    sys.executable,
                    *eval_args,
                    str(runs / "model"),
                    "--shard",
                ]
            )
            res[f"shard{n}"] = {
                "peak_mib_per_rank": [round(x, 1) for x in got],
                "above_constant_x_weights": round((max(got) - const) / weights, 3),
                "val_loss": loss_n,
            }
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, **res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
