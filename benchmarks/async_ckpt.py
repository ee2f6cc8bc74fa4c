"""How long a checkpoint save blocks the training loop, synchronous vs background (train.async_ckpt).

    python benchmarks/async_ckpt.py -- --model.n_layer=12 --model.n_embd=640 ... --train.ckpt_every=18

Runs `loom train` twice, with train.async_ckpt=false and =true, and reads metrics.jsonl: each step's time and,
per save, how long the loop stood still (`ckpt_blocked_s`: the whole save, or staging to host memory plus
waiting for the previous background save) and the part of it spent waiting for the previous save
(`ckpt_waited_s`). Reported per mode: the median normal step (not a save step, not the step after one), the
blocked seconds per save, the step that starts a save (its step time + the blocked time) over a normal step,
and the step that runs while the writer thread works over a normal step; the background save step also over the
synchronous run's normal step (no writer thread beside it). The last save is left out (it is
always waited for). With train.ckpt_every so short that the writer has not finished by the next save, the
loop waits for it (`waited_s`, and a warning in the log): that regime is reported, not hidden.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from loom.metrics import read_jsonl


def run(mode: str, train_args: list[str], tmp: Path) -> dict:
    argv = [
        sys.executable,
        "-m",
        "loom",
        "train",
        f"--run.dir={tmp}",
        f"--run.name={mode}",
        f"--train.async_ckpt={mode}",
        "--train.log_every=1",
        *train_args,
    ]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-3000:])
    recs = read_jsonl(tmp / mode / "metrics.jsonl")
    dt = {rec["step"]: rec["dt"] for rec in recs if "dt" in rec}
    mid = [rec for rec in recs if "ckpt_blocked_s" in rec and rec["step"] != max(dt)]
    starts = {s["step"] for s in mid}
    normal = statistics.median(v for k, v in dt.items() if k > 2 and k not in starts and k - 1 not in starts)
    return {
        "mode": f"async_ckpt={mode}",
        "normal_step_s": round(normal, 3),
        "blocked_s": [round(s["ckpt_blocked_s"], 3) for s in mid],
        "waited_s": [round(s["ckpt_waited_s"], 3) for s in mid],
        "save_step_s": [round(dt[s["step"]] + s["ckpt_blocked_s"], 3) for s in mid],
        "save_step_ratio": [round((dt[s["step"]] + s["ckpt_blocked_s"]) / normal, 2) for s in mid],
        "next_step_ratio": [round(dt[s["step"] + 1] / normal, 2) for s in mid if s["step"] + 1 in dt],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: arguments of `loom train`")
    args = p.parse_args()
    train_args = [a for a in args.train_args if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(mode, train_args, Path(tmp)) for mode in ("false", "true")]
    for r in results:
        print(json.dumps(r))
    sync, bg = (statistics.median(r["blocked_s"]) for r in results)
    print(f"blocked per save: background {bg:.3f}s = {bg / sync:.2f}x of synchronous {sync:.3f}s")
    # The background run's own normal steps include those the writer thread slows; the synchronous run's have no
    # writer beside them: the save step is compared with both.
    clean = results[0]["normal_step_s"]
    results[1]["save_step_vs_sync_normal"] = [round(x / clean, 2) for x in results[1]["save_step_s"]]
    print(
        f"step that starts a save / normal step: background {statistics.median(results[1]['save_step_ratio']):.2f}x"
        f" of its own normal step, {statistics.median(results[1]['save_step_vs_sync_normal']):.2f}x of the "
        f"synchronous run's (max {max(results[1]['save_step_vs_sync_normal']):.2f}x); synchronous "
        f"{statistics.median(results[0]['save_step_ratio']):.2f}x (medians)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, "results": results}, indent=1))


if __name__ == "__main__":
    main()
