"""A rank SIGKILLed inside checkpoint saves, on the restart-from-checkpoint path (issue 59: benchmarks/chaos.py's
DDP run hung there). `loom train --nproc 3 --max-restarts=N --train.ckpt_every=5`; each time a save's
`ckpt/step_N.tmp` appears (steps 10, 15, ...), this script waits the next of --delays seconds and SIGKILLs
rank 2 (the process named `loom rank 2`), then waits for the launcher's restart line before the next one.
Per kill: seconds from the kill to the restart line; per run: how many times the launcher had to SIGKILL
survivors that had not stopped (its "still running ... SIGKILL" line), the exit code and the wall clock.

    loom data prepare --input tinyshakespeare.txt --out /tmp/chaos/data --tokenizer char   (any text)
    .venv/bin/python benchmarks/kill_in_save.py --data /tmp/chaos/data --out /tmp/kill-in-save

Prints one JSON line (also written to --out/kill_in_save.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DELAYS = "0.005,0.01,0.015,0.02,0.025,0.03,0.035,0.04,0.045,0.05,0.055,0.06,0.065,0.07,0.08,0.09"
MODEL = [
    "--model.n_layer=4",
    "--model.n_head=2",
    "--model.n_embd=192",
    "--model.block_size=64",
    "--train.batch_size=6",
    "--train.eval_every=0",
    "--train.eval_batches=1",
    "--train.sample_every=0",
    "--train.log_every=1",
    "--train.device=cpu",
    "--precision.dtype=fp32",
    "--train.ckpt_every=5",
    "--train.keep_last=3",
]


def rank_pid(root: int, rank: int) -> int | None:
    """The pid of `loom rank <rank>` among root's descendants (the name loom's fork server gives a rank)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    kids, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in kids} - kids
        kids |= new
        grew = bool(new)
    for pid in kids - {root}:
        try:
            if (Path("/proc") / str(pid) / "comm").read_text().strip() == f"loom rank {rank}":
                return pid
        except OSError:
            continue
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--delays", default=DELAYS, help="seconds after each save's .tmp appears, comma-separated"
    )
    a = ap.parse_args()
    delays = [float(x) for x in a.delays.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run, steps = out / "r", 10 + 5 * len(delays)
    cmd = [sys.executable, "-m", "loom", "train", "--nproc", "3", f"--max-restarts={len(delays) + 1}"]
    cmd += [f"--data.path={a.data}", f"--run.dir={out}", "--run.name=r", f"--train.steps={steps}", "--force"]
    t0 = time.monotonic()
    log_path = out / "train.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*cmd, *MODEL], stdout=log, stderr=subprocess.STDOUT)

        def restarts() -> int:
            return log_path.read_text().count("starting the 3 processes again")

        done, waits = set(), []
        while proc.poll() is None:
            if len(waits) < len(delays) and (run / "ckpt").is_dir():
                new = {int(p.name[5:11]) for p in (run / "ckpt").glob("step_*.tmp")} - done
                new = sorted(s for s in new if s >= 10)
                pid = rank_pid(proc.pid, 2) if new else None
                if pid is not None:
                    time.sleep(delays[len(waits)])
                    before, t = restarts(), time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    done.add(new[0])
                    while restarts() == before and proc.poll() is None:
                        time.sleep(0.01)
                    waits.append(round(time.monotonic() - t, 2))
            time.sleep(0.002)
    text = log_path.read_text()
    result = {
        "exit": proc.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "kills": len(waits),
        "restarts": restarts(),
        "survivors_sigkilled": text.count("after the stop: SIGKILL"),
        "kill_to_restart_s": waits,
    }
    (out / "kill_in_save.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
