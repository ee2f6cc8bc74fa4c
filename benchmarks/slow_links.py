"""Training over a slow link, for real: two hosts (network namespaces, scripts/netns_hosts.py) x 2 processes,
the link between them limited by tc tbf, one `loom train` job per row launched with `loom launch` on each
host (a Slurm step). One row per run:

    sudo .venv/bin/python benchmarks/slow_links.py --rate 100mbit --mode ddp --out FILE.jsonl
    sudo .venv/bin/python benchmarks/slow_links.py --table FILE.jsonl    # the markdown tables

Modes: ddp (plain DDP over the 4 ranks), hsdp (FSDP inside a host, all-reduce across), bf16, powersgd
(rank 4; DDP communication hooks), diloco20 and diloco100 (DiLoCo across the hosts, DDP inside, H = 20 / 100).
Each row records the wall time of every step (the metrics' dt) and the validation losses, the bytes node1's
eth0 sent and received during the job (the kernel's counters, read with `ip -s link` in its namespace: frames
and headers included; measured, not computed), and the job's wall time. The table's target: the validation
loss plain DDP reaches at --target-step; "time to target" is the sum of step times up to the first
evaluation at or below it (evaluation and start-up left out, the same for every row).

Needs root. Writes one JSON line per run to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from netns_hosts import Hosts, Link  # noqa: E402

PY = sys.executable
STEPS = 200
# 2 layers of width 256 (1.6M parameters, 6.4 MB of fp32 gradients): the gradients, not the compute, set a
# DDP step's time at 100 Mbit/s on this 2-core machine
MODEL = [
    "--model.n_layer=2",
    "--model.n_head=4",
    "--model.n_embd=256",
    "--model.block_size=64",
    "--train.batch_size=16",
    "--train.micro_batch_size=4",
    "--train.eval_every=20",
    "--train.eval_batches=4",
    "--train.sample_every=0",
    "--train.log_every=1",
    "--train.device=cpu",
    "--precision.dtype=fp32",
    "--optim.lr=2e-3",
    "--optim.warmup_steps=10",
]
DILOCO = ["--parallel.dp_impl=ddp", "--parallel.dp_replicate=2"]
MODES = {
    "ddp": ["--parallel.dp_impl=ddp"],
    "hsdp": ["--parallel.dp_impl=fsdp", "--parallel.dp_replicate=2"],
    "bf16": ["--parallel.dp_impl=ddp", "--parallel.grad_compression=bf16"],
    "powersgd": [
        "--parallel.dp_impl=ddp",
        "--parallel.grad_compression=powersgd",
        "--parallel.powersgd_rank=4",
    ],
    "diloco20": [*DILOCO, "--parallel.diloco_inner_steps=20"],
    "diloco100": [*DILOCO, "--parallel.diloco_inner_steps=100"],
    # the outer step as a plain average of the replicas (lr 1, no momentum: local SGD), for comparison
    "diloco20-avg": [
        *DILOCO,
        "--parallel.diloco_inner_steps=20",
        "--parallel.diloco_outer_lr=1",
        "--parallel.diloco_outer_momentum=0",
    ],
}


def env_for(node: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "MASTER_"))}
    env.update(PATH=f"{Path(PY).parent}:{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    env.update(
        SLURM_JOB_ID="779",
        SLURM_NODELIST="node[1-2]",
        SLURM_NNODES="2",
        SLURM_NTASKS="2",
        SLURM_STEP_ID="0",
        SLURM_NODEID=str(node),
        SLURM_PROCID=str(node),
        SLURM_LOCALID="0",
    )
    return env


def data_dir(work: Path) -> Path:
    from loom.verify import prepare_data  # the char-level standard-library set verify trains on

    return prepare_data(work)


def last_logged(metrics: Path) -> int:
    """The newest step in a run's metrics.jsonl (0 before the first; a line being written is skipped)."""
    step = 0
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                step = max(step, json.loads(line).get("step", 0) if "loss" in line else 0)
            except json.JSONDecodeError:
                pass
    return step


def watch_window(hosts, procs, metrics: Path, first: int, last: int) -> dict:
    """node1's sent and received bytes when step `first` is logged and when step `last` is (the interface
    counters read while the job runs): the steps in between alone, after any warm-up."""
    marks = {}
    while any(p.poll() is None for p, _ in procs) and len(marks) < 2:
        step = last_logged(metrics)
        for at in (first, last):
            if at not in marks and step >= at:
                marks[at] = (step, hosts.link_bytes(1))
        time.sleep(0.02)
    if len(marks) < 2:
        return {}
    (s0, b0), (s1, b1) = marks[first], marks[last]
    return {"window": [s0, s1], "tx": b1["tx"] - b0["tx"], "rx": b1["rx"] - b0["rx"]}


def run_row(rate: str, mode: str, steps: int, work: Path, measure_from: int = 0) -> dict:
    data = data_dir(work)
    runs = work / "runs"
    train = [PY, "-m", "loom", "train", f"--data.path={data}", f"--run.dir={runs}", f"--run.name={mode}"]
    train += [f"--train.steps={steps}", "--force", *MODEL, *MODES[mode]]
    launch = [PY, "-m", "loom", "launch", "--nproc-per-node", "2", "--rdzv-timeout", "120", "--"]
    with Hosts(2, link=Link(rate)) as hosts:
        before = hosts.link_bytes(1)
        t0 = time.monotonic()
        procs = []
        for i in (1, 2):
            out = open(work / f"{mode}-node{i}.out", "w")  # noqa: SIM115  (closed with the process)
            procs.append((hosts.popen(i, [*launch, *train], env=env_for(i - 1), stdout=out, stderr=out), out))
        window = (
            watch_window(hosts, procs, runs / mode / "metrics.jsonl", measure_from, steps)
            if measure_from
            else {}
        )
        codes = [p.wait(3600) for p, _ in procs]
        wall = time.monotonic() - t0
        after = hosts.link_bytes(1)
    for _, out in procs:
        out.close()
    if codes != [0, 0]:
        raise SystemExit(
            f"{mode} at {rate} failed {codes}: {(work / f'{mode}-node1.out').read_text()[-3000:]}"
        )
    rows = [json.loads(x) for x in (runs / mode / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {
        "rate": rate,
        "mode": mode,
        "steps": steps,
        "args": MODEL + MODES[mode],
        "wall_s": wall,
        "dt": {str(r["step"]): r["dt"] for r in rows if "loss" in r},
        "val": {str(r["step"]): r["val_loss"] for r in rows if "val_loss" in r},
        "allreduce_bytes": next((r["allreduce_bytes"] for r in rows if "allreduce_bytes" in r), None),
        "node1_tx": after["tx"] - before["tx"],
        "node1_rx": after["rx"] - before["rx"],
        **({"node1_window": window} if window else {}),
    }


def time_to(row: dict, target: float) -> float | None:
    for step, v in sorted((int(s), v) for s, v in row["val"].items()):
        if v <= target:
            return sum(dt for s, dt in row["dt"].items() if int(s) <= step)
    return None


def table(path: Path, target_step: int) -> str:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        mine = {r["mode"]: r for r in rows if r["rate"] == rate}  # the last run of each mode
        ddp = mine.get("ddp")
        target = ddp["val"][str(target_step)] if ddp else None
        inner = mine.get("diloco20")  # its steps between outer steps: compute, no traffic across the link
        base = None
        if inner:
            quiet = sorted(dt for st, dt in inner["dt"].items() if int(st) % 20)
            base = quiet[len(quiet) // 2]
        out += [
            f"\n### {rate}"
            + (f" (target: plain DDP's val loss at step {target_step}, {target:.4f})" if target else ""),
            "",
            "| mode | s/step | comm share | time to target (s) | vs DDP | final val loss | vs DDP | bytes/step sent by node1 | vs DDP |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for mode, r in mine.items():
            steps, last = r["steps"], r["val"][str(r["steps"])]
            per_step = r["node1_tx"] / steps
            t = time_to(r, target) if target else None
            t_ddp = time_to(ddp, target) if target else None
            speed = f"{t_ddp / t:.1f}x sooner" if t and t_ddp else "-"
            loss_vs = f"{100 * (last / ddp['val'][str(steps)] - 1):+.2f}%" if ddp else "-"
            bytes_vs = f"1/{ddp['node1_tx'] / r['node1_tx']:.1f}" if ddp else "-"
            mean = sum(r["dt"].values()) / steps
            share = f"{max(0.0, 1 - base / mean):.0%}" if base else "-"
            out.append(
                f"| {mode} | {mean:.3f} | {share} | {f'{t:.1f}' if t else 'not reached'} | {speed} | "
                f"{last:.4f} | {loss_vs} | {per_step / 1e6:.2f} MB | {bytes_vs} |"
            )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--mode", choices=list(MODES))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/cpu-2core-2026-11-28/slow_links.jsonl"
    )
    p.add_argument("--table", type=Path, default=None, help="print the tables of a --out file and stop")
    p.add_argument("--target-step", type=int, default=160)
    p.add_argument(
        "--measure-from",
        type=int,
        default=0,
        help="also read node1's counters when this step and the last are logged: bytes per step over those "
        "steps alone (after PowerSGD's warm-up: 10 steps by default)",
    )
    args = p.parse_args()
    if args.table:
        print(table(args.table, args.target_step))
        return 0
    with tempfile.TemporaryDirectory(prefix="slowlinks-") as tmp:
        work = Path(os.environ.get("SLOW_LINKS_WORK", tmp))
        row = run_row(args.rate, args.mode, args.steps, work, args.measure_from)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    v = row["val"][str(row["steps"])]
    print(
        f"{args.rate} {args.mode}: {row['wall_s']:.0f}s, final val {v:.4f}, node1 sent {row['node1_tx']:,} B"
    )
    w = row.get("node1_window")
    if w:
        n = w["window"][1] - w["window"][0]
        print(f"  steps {w['window'][0] + 1}-{w['window'][1]}: node1 sent {w['tx'] / n:,.0f} B/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
