"""Chaos under torchft (issue 59, item 5): 3 replica groups (`loom train --nproc 3 --ft.enabled=true`), one of
them SIGKILLed every --every steps (groups 1, 2, 1, ... in turn; from this script, as a node failure would),
against the same run without failures, and the same failure schedule under today's path: DDP on 3 processes
with `--max-restarts`, where every kill stops all ranks and they resume from the newest checkpoint
(train.ckpt_every=--ckpt-every).

    loom data prepare --input tinyshakespeare.txt --out /tmp/chaos/data --tokenizer char   (any text)
    .venv/bin/python benchmarks/chaos.py --data /tmp/chaos/data --out /tmp/chaos

--heartbeat sets ft.heartbeat_s (the lighthouse's heartbeat timeout: how soon the survivors go on without a dead
group); --n-embd / --n-layer / --block-size the model (a step of a realistic share of the fixed cost);
--partition-at STEP cuts the last group off once for --partition-s seconds (SIGSTOP of its process, then
SIGCONT; across hosts its host's link to the bridge goes down, then up: a network partition). --group-size 2 makes each replica group an FSDP shard group of 2 ranks (HSDP: `--nproc 6
--parallel.dp_impl=fsdp --parallel.dp_replicate=3`, the same layout without ft on the restart path); a kill
is then of rank 1 of the group (its launcher stops the group's other rank). --hosts runs the ft runs across 3 network-namespace hosts instead (scripts/netns_hosts.py, root): the
lighthouse (torchft's own binary) on node1, group k on node k+1, each started by hand as a cluster would
(`loom train --ft.enabled=true` with the group's number and the lighthouse's address), and restarted by this
script, as a node's scheduler would, after it kills it.

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
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from loom.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
# a group's TCPStore on its host (what `loom train --nproc` serves each group on 127.0.0.1), reachable by the
# other hosts: torchft hands the quorum's store address to every group
STORE = (
    "import sys, time, datetime, torch.distributed as d; "
    "s = d.TCPStore(sys.argv[1], 29500, is_master=True, wait_for_workers=False, multi_tenant=True, "
    "timeout=datetime.timedelta(seconds=60)); time.sleep(1e9)"
)
MODEL = [
    "--model.n_head=2",
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
                    parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    if parent in kids:
                        kids.add(int(d.name))
                        # the named process, not a child forked from it (which keeps its name)
                        if _comm(d.name) == name and _comm(str(parent)) != name:
                            found = int(d.name)
                except (OSError, IndexError, ValueError):
                    continue
    return found


def _comm(pid: str) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def pid_within(root: int, name: str) -> int | None:
    """pid_named, where "A/B" names the process B under the process A (a rank of one replica group)."""
    *outer, inner = name.split("/")
    if outer and (root := pid_named(root, outer[0])) is None:
        return None
    return pid_named(root, inner)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return read_jsonl(path, superseded=True) if path.exists() else []


def last_step(run: Path) -> int:
    return max((r["step"] for r in records(run) if "loss" in r), default=0)


def stop(pid: int, cut: bool) -> None:
    """The partition on one machine: the process stopped (SIGSTOP), then continued."""
    os.kill(pid, signal.SIGSTOP if cut else signal.SIGCONT)


def killer(done, find, run0: Path, a, names: list[str], log: list[dict], sever=stop) -> None:
    """SIGKILL names[i % len] (`find(name)`: its pid, None while it restarts) when run0 passes step
    a.every * (i + 1); cut names[-1] off once at a.partition_at for a.partition_s seconds (`sever(pid, True)`,
    then `sever(pid, False)`: SIGSTOP/SIGCONT here, its host's link down/up across hosts)."""
    i, cut = 0, a.partition_at > 0
    while not done():
        step = last_step(run0)
        if cut and step >= a.partition_at and (pid := find(names[-1])) is not None:
            sever(pid, True)
            log.append({"step": step, "partitioned": names[-1], "t": time.monotonic()})
            time.sleep(a.partition_s)
            sever(pid, False)
            cut = False
        if a.every * (i + 1) < a.steps and step >= a.every * (i + 1):
            name = names[i % len(names)]
            pid = find(name)
            if pid is None:  # being restarted: try again in a moment
                time.sleep(0.05)
                continue
            os.kill(pid, signal.SIGKILL)
            log.append({"step": step, "killed": name, "t": time.monotonic()})
            i += 1
        time.sleep(0.02)


def run(name: str, cmd: list[str], out: Path, a, kill: list[str]) -> dict:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with open(out / "logs" / f"{name}.log", "w") as log_file:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        kills: list[dict] = []
        find = functools.partial(pid_within, proc.pid)
        args = (lambda: proc.poll() is not None, find, out / name, a, kill, kills)
        if kill:
            threading.Thread(target=killer, args=args, daemon=True).start()
        code = proc.wait()
        wall = time.monotonic() - t0
    return summary(name, out, code, wall, kills)


def summary(name: str, out: Path, code: int, wall: float, events: list[dict]) -> dict:
    """The run's figures from its records and its log (out/logs/<name>.log)."""
    kills = [e for e in events if "killed" in e]
    recs = records(out / name)
    text = (out / "logs" / f"{name}.log").read_text(errors="replace")
    losses = [r["step"] for r in recs if "loss" in r]
    changes = [(r["step"], r["ft"]) for r in recs if "ft" in r]
    rejoin = []
    for k in kills:  # the time from the kill to group 0's first quorum change that has the group back
        group = re.search(r"ft g(\d+)", k["killed"])  # "loom ft g1" or "loom ft g1/loom rank 1"
        g = int(group[1]) if group else None
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
        "partitioned_at": [e["step"] for e in events if "partitioned" in e],
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


def run_hosts(name: str, cmd: list[str], out: Path, a, kill: bool) -> dict:
    """One ft run across 3 namespace hosts: the lighthouse on node1, group k started on node k+1 by hand (its
    number, the lighthouse and its own host's store address in its environment, as loom train --nproc gives
    them to a group), restarted with train.resume=auto when it dies, as a node's scheduler would."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from netns_hosts import Hosts

    (out / "logs").mkdir(parents=True, exist_ok=True)
    url = "http://10.77.0.1:29510"
    beat = str(round(1000 * a.heartbeat))
    lighthouse = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1"]
    lighthouse += ["--bind", "10.77.0.1:29510", "--heartbeat_timeout_ms", beat]
    lighthouse += ["--join_timeout_ms", "10000", "--quorum_tick_ms", "10"]
    log_file = open(out / "logs" / f"{name}.log", "w")
    with Hosts(3) as hosts:

        def start(k: int, again: bool) -> subprocess.Popen:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "LOOM_FT_REPLICA": str(k), "TORCHFT_LIGHTHOUSE": url}
            env.update(MASTER_ADDR=hosts.addr(k + 1), MASTER_PORT="29500", WORLD_SIZE="1", RANK="0")
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            group = [f"--run.name={name if k == 0 else f'{name}-g{k}'}", "--ft.replica_groups=3"]
            group += [f"--ft.job_name={name}", *(["--train.resume=auto"] if again else ["--force"])]
            return hosts.popen(k + 1, [*cmd, *group], env=env, stdout=log_file, stderr=subprocess.STDOUT)

        hosts.popen(1, lighthouse, stdout=log_file, stderr=subprocess.STDOUT)
        for k in range(3):  # each host's store for its group, as the launcher serves one per group
            hosts.popen(
                k + 1, [sys.executable, "-c", STORE, hosts.addr(k + 1)], stdout=log_file, stderr=log_file
            )
        time.sleep(5.0)  # the stores import torch
        t0 = time.monotonic()
        procs = {k: start(k, False) for k in range(3)}
        codes: dict[int, int] = {}
        events: list[dict] = []
        find = lambda g: procs[int(g[-1])].pid if procs[int(g[-1])].poll() is None else None  # noqa: E731
        args = (lambda: len(codes) == 3, find, out / name, a, ["g1", "g2"], events)

        def sever(pid: int, cut: bool) -> None:  # a real partition: group 2's host (node3) off the bridge
            updown = "down" if cut else "up"
            subprocess.run(["ip", "-n", hosts.switch, "link", "set", "h3", updown], check=True)

        if kill:
            threading.Thread(target=killer, args=(*args, sever), daemon=True).start()
        while len(codes) < 3:
            for k, p in procs.items():
                if k not in codes and p.poll() is not None:
                    restarts = sum(1 for e in events if "restart" in e)
                    ended = 0 in codes.values()  # the job is done: started again, a group trains alone
                    if (
                        p.returncode in (-signal.SIGKILL, 1) and restarts < 5 and not ended
                    ):  # a kill, QuorumLost
                        events.append({"restart": k})
                        log_file.write(f"chaos: group {k} ended; the others go on; starting it again\n")
                        log_file.flush()
                        procs[k] = start(k, True)
                    else:
                        codes[k] = p.returncode
            time.sleep(0.05)
        wall = time.monotonic() - t0
    log_file.close()
    code = max(codes.values(), key=abs)
    return summary(
        name,
        out,
        code,
        wall,
        [{**e, "killed": f"loom ft {e['killed']}"} if "killed" in e else e for e in events],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--heartbeat", type=float, default=2.0, help="ft.heartbeat_s")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--partition-at", type=int, default=0, help="the step group 2 is cut off at (0: never)")
    ap.add_argument("--partition-s", type=float, default=3.0)
    ap.add_argument("--hosts", action="store_true", help="ft across 3 network-namespace hosts (root)")
    ap.add_argument("--group-size", type=int, default=1, help="ranks per replica group (2: HSDP groups)")
    ap.add_argument("--runs", default="ft,ddp", help="which pairs (clean and chaos) to run: ft, ddp or both")
    a = ap.parse_args()
    out = Path(a.out)
    model = [
        f"--model.n_embd={a.n_embd}",
        f"--model.n_layer={a.n_layer}",
        f"--model.block_size={a.block_size}",
    ]
    train = [sys.executable, "-m", "loom", "train"]
    common = [f"--data.path={a.data}", f"--run.dir={out}", f"--train.steps={a.steps}", *MODEL, *model]
    ft = ["--ft.enabled=true", "--train.ckpt_every=0", f"--ft.heartbeat_s={a.heartbeat}"]
    if a.hosts:
        rows = {
            n: run_hosts(n, [*train, *common, *ft], out, a, "chaos" in n) for n in ("ft-clean", "ft-chaos")
        }
    else:
        size = a.group_size
        hsdp = ["--parallel.dp_impl=fsdp", "--parallel.dp_replicate=3"] if size > 1 else []
        base = [*train, "--nproc", str(3 * size), *common, *hsdp, "--force"]
        ddp = [f"--train.ckpt_every={a.ckpt_every}", "--max-restarts=10"]
        in_group = (lambda k: f"loom ft g{k}/loom rank 1") if size > 1 else (lambda k: f"loom ft g{k}")
        plan = [
            ("ft-clean", [*base, "--run.name=ft-clean", *ft], []),
            ("ft-chaos", [*base, "--run.name=ft-chaos", *ft], [in_group(1), in_group(2)]),
            ("ddp-clean", [*base, "--run.name=ddp-clean", *ddp], []),
            (
                "ddp-chaos",
                [*base, "--run.name=ddp-chaos", *ddp],
                [*(f"loom rank {k * size + size - 1}" for k in (1, 2))],
            ),
        ]
        wanted = a.runs.split(",")
        rows = {
            name: run(name, cmd, out, a, kill) for name, cmd, kill in plan if name.split("-")[0] in wanted
        }
    for name in [n for n in rows if "chaos" in n]:
        clean = rows[name.replace("chaos", "clean")]
        rows[name]["overhead"] = round(rows[name]["wall_s"] / clean["wall_s"] - 1, 3)
        steps = [r for r in records(out / clean["run"]) if "dt" in r and r["step"] > 10]
        rows[name]["clean_step_s"] = round(statistics.median(r["dt"] for r in steps), 4) if steps else None
    (out / "chaos.json").write_text(json.dumps(rows, indent=1))
    print(
        "| run | exit | wall s | overhead vs clean | kills at | partitioned at | job restarts | group restarts | "
        "steps recomputed | steps not committed | rows skipped | heal s | survivors' quorum wait s | "
        "kill→back (steps) | final val loss |"
    )
    print("|" + "---|" * 15)
    for r in rows.values():
        heal = ", ".join(f"{h:.2f}" for h in r["heal_s"]) or "-"
        stall = ", ".join(f"{h:.2f}" for h in r["stall_s"]) or "-"
        loss = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        print(
            f"| {r['run']} | {r['exit']} | {r['wall_s']} | {r.get('overhead', '-')} | {r['kills'] or '-'} | "
            f"{r['partitioned_at'] or '-'} | {r['job_restarts']} | {r['group_restarts']} | "
            f"{r['steps_recomputed']} | {r['uncommitted']} | {r['rows_skipped']} | {heal} | {stall} | "
            f"{r['rejoin_steps'] or '-'} | {loss} |"
        )
    print("median clean step s:", {n: r.get("clean_step_s") for n, r in rows.items() if "chaos" in n})


if __name__ == "__main__":
    main()
