"""A rank slowed from outside loom, as a user would see it (issue 59, item 4): `loom train --nproc N` (DDP on
gloo; --layout fsdp: FSDP2, pp: a pipeline of N stages), and from this script, not from loom, SIGSTOP / SIGCONT of one rank's process on a duty cycle (stopped
--stopped of the time, periods of --period seconds) from the run's first straggler window on. Then the same run
unslowed. One table: for each run, the windows, which rank each names, the window the warning came in
(counted from the slowdown's start), the share of a step the slowed rank and the others spent waiting in
collectives, and the same records judged as loom judged them before issue 59 (the waits folded back into the
backward where DDP hides them, `other` left out: what loom measured then).

    loom data prepare --input tinyshakespeare.txt --out /tmp/strag/data --tokenizer char   (any text)
    .venv/bin/python benchmarks/stragglers_outside.py --data /tmp/strag/data --out /tmp/strag

Prints the markdown table; writes every window's record to --out/windows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from loom.metrics import read_jsonl

MODEL = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.block_size=64",
    "--train.batch_size=12",
    "--train.eval_every=0",
    "--train.sample_every=0",
    "--train.log_every=1",
    "--train.device=cpu",
    "--precision.dtype=fp32",
    "--train.ckpt_every=0",
]
OLD = ("data", "forward", "backward", "comm", "optimizer")
# --layout: the data parallelism, or a pipeline of --nproc stages (its forward phase runs the whole schedule)
LAYOUTS = {
    "ddp": [],
    "fsdp": ["--parallel.dp_impl=fsdp"],
    "pp": ["--parallel.pp_microbatches=2"],  # --parallel.pp=nproc added below
}


def rank_pid(root: int, rank: int) -> int | None:
    """The pid of `rank` among root's descendants ("loom rank N", the name loom's fork server gives it)."""
    kids = {root}
    for _ in range(4):
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    if ppid in kids:
                        kids.add(int(d.name))
                        if (d / "comm").read_text().strip() == f"loom rank {rank}":
                            return int(d.name)
                except (OSError, IndexError, ValueError):
                    continue
    return None


def windows_of(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    recs = read_jsonl(path, superseded=True) if path.exists() else []
    return [{"step": r["step"], **r["stragglers"]} for r in recs if "stragglers" in r]


def last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    recs = read_jsonl(path, superseded=True) if path.exists() else []
    return max([r["step"] for r in recs if "loss" in r], default=0)


def duty_cycle(pid: int, stopped: float, period: float, done: threading.Event) -> None:
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped * period)
            os.kill(pid, signal.SIGCONT)
            done.wait((1 - stopped) * period)
    except ProcessLookupError:
        return
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run(args, name: str, slow: bool) -> dict:
    out = args.out / name
    cmd = [sys.executable, "-m", "loom", "train", f"--data.path={args.data}", f"--run.dir={args.out}"]
    cmd += [f"--run.name={name}", f"--train.steps={args.steps}", "--nproc", str(args.nproc), *MODEL]
    cmd += [f"--model.n_embd={args.n_embd}"]
    cmd += [f"--train.straggler_every={args.every}", f"--train.straggler_windows={args.windows}"]
    cmd += [f"--train.straggler_threshold={args.threshold}", *LAYOUTS[args.layout]]
    log = open(args.out / f"{name}.log", "w")
    p = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    began, done = None, threading.Event()
    if slow:
        while not windows_of(out) and p.poll() is None:
            time.sleep(0.01)
        pid = rank_pid(p.pid, args.rank)
        assert pid is not None, "rank process not found"
        threading.Thread(target=duty_cycle, args=(pid, args.stopped, args.period, done), daemon=True).start()
        began = last_step(out) + 2  # the ranks are at most a step past rank 0's last record
    try:
        assert p.wait() == 0, (args.out / f"{name}.log").read_text()[-3000:]
    finally:
        done.set()
    text = (args.out / f"{name}.log").read_text()
    return {
        "name": name,
        "began": began,
        "windows": windows_of(out),
        "warned": "has been the slowest" in text,
    }


def old_verdict(w: dict, threshold: float, nproc: int, fold: str = "backward") -> int | None:
    """The rank loom before issue 59 named in this window (its judge, as it was): the waits back in the
    phase that hid them (`fold`: DDP's and FSDP's backward, a pipeline's forward: the schedule), `other`
    unmeasured, each phase compared with its median over all ranks."""
    if nproc < 3:
        return None
    ph = w["phases_s"]
    old = {p: list(ph.get(p, [0.0] * nproc)) for p in OLD}
    zero = [0.0] * nproc  # the waits (and the stalls inside them) back where the collectives hid them
    hidden = zip(ph[fold], ph.get("wait", zero), ph.get("stalled", zero), strict=True)
    old[fold] = [b + w + s for b, w, s in hidden]
    median = {p: statistics.median(old[p]) for p in OLD}
    excess = [sum(max(0.0, old[p][r] - median[p]) for p in OLD) for r in range(nproc)]
    worst = max(range(nproc), key=lambda r: excess[r])
    step_s = statistics.median(sum(old[p][r] for p in OLD) for r in range(nproc))
    return worst if step_s > 0 and excess[worst] > threshold * step_s else None


def summary(args, r: dict) -> dict:
    ws = r["windows"]
    slowed = [w for w in ws if r["began"] is not None and w["step"] - args.every + 1 >= r["began"]]
    named = [w["slowest"]["rank"] if w["slowest"] else None for w in ws]
    warn_at = next(
        (i for i, w in enumerate(ws) if w["slowest"] and w["slowest"]["in_a_row"] >= args.windows), None
    )
    start = next((i for i, w in enumerate(ws) if w["step"] >= (r["began"] or 0)), None)
    share = {}
    for w in slowed or ws[1:]:
        for k, (wait, step) in enumerate(zip(w["phases_s"]["wait"], w["step_s"], strict=True)):
            share.setdefault(k, []).append(wait / step if step else 0.0)
    fold = "forward" if args.layout == "pp" else "backward"
    old = [old_verdict(w, args.threshold, args.nproc, fold) for w in ws]
    return {
        "run": r["name"],
        "windows": len(ws),
        "named": named,
        "old_named": old,
        "warned": r["warned"],
        "windows_to_warning": None if warn_at is None or start is None else warn_at - start + 1,
        "wait_share": {k: statistics.mean(v) for k, v in share.items()},
        "step_ms": statistics.median(statistics.median(w["step_s"]) for w in (slowed or ws)) * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--rank", type=int, default=1, help="the rank stopped")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=0.2)
    ap.add_argument("--stopped", type=float, default=0.8, help="the share of each period the rank is stopped")
    ap.add_argument("--period", type=float, default=0.25)
    ap.add_argument("--n-embd", type=int, default=128, help="the model's width (2 layers, 2 heads)")
    ap.add_argument("--layout", choices=list(LAYOUTS), default="ddp", help="pp: --nproc pipeline stages")
    args = ap.parse_args()
    if args.layout == "pp":
        LAYOUTS["pp"].append(f"--parallel.pp={args.nproc}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [summary(args, run(args, "slowed", True)), summary(args, run(args, "balanced", False))]
    (args.out / "windows.json").write_text(json.dumps(rows, indent=1))
    print(
        f"{args.layout}, {args.nproc} ranks, windows of {args.every} steps, threshold {args.threshold}, "
        f"warn after {args.windows}"
    )
    print(
        "| run | windows | named (now) | named (judged as before) | warned | windows to the warning | "
        "wait share per rank | median step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for s in rows:
        share = " / ".join(f"r{k} {100 * v:.0f}%" for k, v in sorted(s["wait_share"].items()))
        print(
            f"| {s['run']} | {s['windows']} | {s['named']} | {s['old_named']} | {s['warned']} | "
            f"{s['windows_to_warning']} | {share} | {s['step_ms']:.0f} ms |"
        )


if __name__ == "__main__":
    main()
