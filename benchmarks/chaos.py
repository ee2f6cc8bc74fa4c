"""Chaos under torchft (issue 59, item 5): 3 replica groups (`loom train --nproc 3 --ft.enabled=true`), one of
them SIGKILLed every --every steps (groups 1, 2, 1, ... in turn; from this script, as a node failure would),
against the same run without failures, and the same failure schedule under today's path: DDP on 3 processes
with `--max-restarts`, where every kill stops all ranks and they resume from the newest checkpoint
(train.ckpt_every=--ckpt-every).

    loom data prepare --input tinyshakespeare.txt --out /tmp/chaos/data --tokenizer char   (any text)
    .venv/bin/python benchmarks/chaos.py --data /tmp/chaos/data --out /tmp/chaos

Reported per run: wall clock and its overhead against the fault-free run of the same path, whether the job
restarted, steps recomputed (steps logged more than once: the restart path replays them), steps not committed
(ft: the quorum skipped them), the rows skipped while a group was missing (ft_rows_skipped: the missing
groups' slices of those steps), the heal times the healed groups recorded and the time from a kill until the
survivors' quorum had the group back, and the final validation loss. Under ft the val loss is group 0's, on
its third of the validation set (loom.distributed.ft: each group reads its DDP rank's slice), so compare ft
with ft and DDP with DDP. Prints the markdown table; writes every figure to --out/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from loom.metrics import read_jsonl

MODEL = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=64",
    "--model.block_size=64",
    "--train.batch_size=12",
    "--train.eval_every=0",
    "--train.sample_every=0",
    "--train.log_every=1",
    "--train.device=cpu",
    "--precision.dtype=fp32",
    "--train.eval_batches=4",
]


def pid_named(root: int, name: str) -> int | None:
    """The pid of the process called `name` among root's descendants (the names loom's fork server gives)."""
    kids, found = {root}, None
    for _ in range(4):
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) in kids:
                        kids.add(int(d.name))
                        if (d / "comm").read_text().strip() == name:
                            found = int(d.name)
                except (OSError, IndexError, ValueError):
                    continue
    return found


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return read_jsonl(path, superseded=True) if path.exists() else []


def last_step(run: Path) -> int:
    return max((r["step"] for r in records(run) if "loss" in r), default=0)


def killer(proc, run0: Path, every: int, steps: int, names: list[str], log: list[dict]) -> None:
    """SIGKILL names[i % len] when run0 passes step every * (i + 1); note when group-0 sees it back."""
    import os
    import signal

    i = 0
    while proc.poll() is None and every * (i + 1) < steps:
        if last_step(run0) >= every * (i + 1):
            name = names[i % len(names)]
            pid = pid_named(proc.pid, name)
            if pid is None:  # being restarted: try again in a moment
                time.sleep(0.05)
                continue
            os.kill(pid, signal.SIGKILL)
            log.append({"step": last_step(run0), "killed": name, "t": time.monotonic()})
            i += 1
        time.sleep(0.02)


def run(name: str, cmd: list[str], out: Path, every: int, steps: int, kill: list[str]) -> dict:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with open(out / "logs" / f"{name}.log", "w") as log_file:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        kills: list[dict] = []
        t = threading.Thread(target=killer, args=(proc, out / name, every, steps, kill, kills), daemon=True)
        if kill:
            t.start()
        code = proc.wait()
        wall = time.monotonic() - t0
    recs = records(out / name)
    text = (out / "logs" / f"{name}.log").read_text(errors="replace")
    losses = [r["step"] for r in recs if "loss" in r]
    changes = [(r["step"], r["ft"]) for r in recs if "ft" in r]
    rejoin = []
    for k in kills:  # the time from the kill to group 0's first quorum change that has the group back
        g = int(k["killed"].rsplit("g", 1)[1]) if "ft" in k["killed"] else None
        back = [s for s, c in changes if g is not None and g in c["joined"] and s >= k["step"]]
        rejoin.append(back[0] - k["step"] if back else None)
    heals = [
        c["heal_s"]
        for d in out.glob(f"{name}-g*")
        for c in (r.get("ft") or {} for r in records(d))
        if "heal_s" in c
    ]
    return {
        "run": name,
        "exit": code,
        "wall_s": round(wall, 2),
        "kills": [k["step"] for k in kills],
        "job_restarts": text.count("a worker failed; starting the"),
        "group_restarts": text.count("the others go on; starting it again"),
        "steps_recomputed": len(losses) - len(set(losses)),
        "uncommitted": sum(1 for r in recs if str(r.get("skipped", "")).startswith("ft:")),
        "rows_skipped": max((r.get("ft_rows_skipped", 0) for r in recs), default=0),
        "heal_s": heals,
        "stall_s": [c["quorum_s"] for _, c in changes[1:]],  # group 0's waits in the quorums that changed
        "rejoin_steps": rejoin,
        "val_loss": next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=20)
    a = ap.parse_args()
    out = Path(a.out)
    base = [
        sys.executable,
        "-m",
        "loom",
        "train",
        "--nproc",
        "3",
        f"--data.path={a.data}",
        f"--run.dir={out}",
    ]
    base += [f"--train.steps={a.steps}", *MODEL, "--force"]
    ft = ["--ft.enabled=true", "--train.ckpt_every=0"]
    ddp = [f"--train.ckpt_every={a.ckpt_every}", "--max-restarts=10"]
    plan = [
        ("ft-clean", [*base, "--run.name=ft-clean", *ft], []),
        ("ft-chaos", [*base, "--run.name=ft-chaos", *ft], ["loom ft g1", "loom ft g2"]),
        ("ddp-clean", [*base, "--run.name=ddp-clean", *ddp], []),
        ("ddp-chaos", [*base, "--run.name=ddp-chaos", *ddp], ["loom rank 1", "loom rank 2"]),
    ]
    rows = {name: run(name, cmd, out, a.every, a.steps, kill) for name, cmd, kill in plan}
    for name in ("ft-chaos", "ddp-chaos"):
        clean = rows[name.replace("chaos", "clean")]
        rows[name]["overhead"] = round(rows[name]["wall_s"] / clean["wall_s"] - 1, 3)
    (out / "chaos.json").write_text(json.dumps(rows, indent=1))
    print(
        "| run | exit | wall s | overhead vs clean | kills at | job restarts | group restarts | steps recomputed | steps not "
        "committed | rows skipped | heal s | survivors' quorum wait s | kill→back (steps) | final val loss |"
    )
    print("|" + "---|" * 14)
    for r in rows.values():
        heal = ", ".join(f"{h:.2f}" for h in r["heal_s"]) or "-"
        stall = ", ".join(f"{h:.2f}" for h in r["stall_s"]) or "-"
        print(
            f"| {r['run']} | {r['exit']} | {r['wall_s']} | {r.get('overhead', '-')} | {r['kills'] or '-'} | "
            f"{r['job_restarts']} | {r['group_restarts']} | {r['steps_recomputed']} | {r['uncommitted']} | {r['rows_skipped']} | {heal} | {stall} | "
            f"{r['rejoin_steps'] or '-'} | {r['val_loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
