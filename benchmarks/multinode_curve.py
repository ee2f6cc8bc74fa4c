"""Two hosts (network namespaces, scripts/netns_hosts.py) x 2 processes, HSDP (replicate across the hosts,
shard within), launched with `loom launch -- loom train ...` on each host as a Slurm step and as PBS's
pbsdsh start it, and once from a PBS job script through MPICH's mpiexec; each 30-step curve against one
process. Then the Slurm run resumed from its step-15 checkpoint on one host (one process); --max-restarts
with node2 killed and started again; and the all-reduce bandwidth `loom doctor --nodes` reports.

    sudo .venv/bin/python benchmarks/multinode_curve.py [--steps 30] [--out FILE]

Needs root (ip netns add). Writes a JSON summary (default benchmarks/results/cpu-2core-2026-11-23/
multinode_curve.json). The test suite runs the Slurm curve and resume (tests/netns); this adds the rest.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
from conftest import make_text  # noqa: E402  (the test suite's deterministic pseudo-English)
from netns_hosts import Hosts  # noqa: E402

PY = sys.executable
print = functools.partial(print, flush=True)  # noqa: A001  (progress shows while the next run starts)
TINY = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--model.block_size=16",
    "--train.batch_size=8",
    "--train.eval_batches=1",
    "--train.eval_every=0",
    "--train.sample_every=0",
    "--train.log_every=1",
    "--train.device=cpu",
    "--optim.warmup_steps=2",
    "--train.sample_tokens=8",
]
HSDP = ["--parallel.dp_impl=fsdp", "--parallel.dp_replicate=2"]


def env_for(scheduler: str, node: int, work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "MASTER_"))}
    env.update(PATH=f"{Path(PY).parent}:{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    if scheduler == "slurm":
        env.update(
            SLURM_JOB_ID="777",
            SLURM_NODELIST="node[1-2]",
            SLURM_NNODES="2",
            SLURM_STEP_ID="0",
            SLURM_NODEID=str(node),
            SLURM_PROCID=str(node),
            SLURM_LOCALID="0",
        )
    else:
        nodefile = work / "pbs_nodefile"
        nodefile.write_text("node1\nnode1\nnode2\nnode2\n")
        env.update(PBS_JOBID="778.pbs01", PBS_NODEFILE=str(nodefile), PBS_NODENUM=str(node))
    return env


def curve(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def worst(got: dict[int, float], ref: dict[int, float]) -> float:
    return max(abs(v - ref[s]) for s, v in got.items())


def mpiexec_from_the_job_script(hosts, base: list[str], work: Path, ref: dict[int, float]) -> dict:
    """A PBS job script's loom launch (node1, no PBS_NODENUM): MPICH's mpiexec over the nodefile, its
    proxies started on each host through the namespaces' ssh stand-in (HYDRA_LAUNCHER_EXEC)."""
    env = env_for("pbs", 0, work)
    del env["PBS_NODENUM"]
    env.update(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=str(hosts.ssh))
    t0 = time.monotonic()
    r = hosts.run(
        1,
        [PY, "-m", "loom", "launch", "--nproc-per-node", "2", "--", *base, "--run.name=hsdp-mpiexec", *HSDP],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        sys.exit(f"mpiexec run failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    got = curve(work / "runs" / "hsdp-mpiexec")
    out = {"max_abs_dloss": worst(got, ref), "steps": len(got), "wall_s": round(time.monotonic() - t0, 1)}
    print(f"mpiexec: {out}")
    return out


def restart_when_the_host_comes_back(hosts, base: list[str], work: Path, ref: dict[int, float]) -> dict:
    """--max-restarts 1: kill node2 after a checkpoint, start its loom launch again; the job resumes."""
    run = work / "runs" / "restart"
    every = max(2, len(ref) // 6)
    cmd = [
        *base,
        "--run.name=restart",
        "--train.resume=auto",
        f"--train.ckpt_every={every}",
        *HSDP,
        "--parallel.timeout_s=5",
    ]
    launch = [
        PY,
        "-m",
        "loom",
        "launch",
        "--nproc-per-node",
        "2",
        "--rdzv-timeout",
        "120",
        "--max-restarts",
        "1",
    ]

    def start(i: int, tag: str) -> subprocess.Popen:
        out = open(work / f"restart-node{i}-{tag}.out", "w")
        return hosts.popen(
            i, [*launch, "--", *cmd], env=env_for("slurm", i - 1, work), stdout=out, stderr=subprocess.STDOUT
        )

    first = [start(1, "a"), start(2, "a")]
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and len(curve(run)) >= every + 2):
        if time.monotonic() > deadline or first[0].poll() is not None:
            sys.exit(
                "restart run did not reach its first checkpoint:\n"
                + (work / "restart-node1-a.out").read_text()
            )
        time.sleep(0.05)
    killed_at = max(curve(run))
    hosts.kill(2)
    first[1].wait()
    time.sleep(3)
    t0 = time.monotonic()
    again = start(2, "b")
    codes = [first[0].wait(600), again.wait(600)]
    got = curve(run)  # a step replayed after the restart keeps its last value
    text = (work / "restart-node1-a.out").read_text()
    out = {
        "killed_after_step": killed_at,
        "exit_codes": codes,
        "steps": len(got),
        "seconds_from_comeback_to_end": round(time.monotonic() - t0, 1),
        "resumed": "resumed from" in text,
        "max_abs_dloss": worst(got, ref),
    }
    print(f"--max-restarts: {out}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/cpu-2core-2026-11-23/multinode_curve.json")
    )
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: network namespaces (ip netns add)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the hosts down when stopped
    work = Path(tempfile.mkdtemp(prefix="loomt-bench-"))
    try:
        docs = work / "docs"
        docs.mkdir()
        for i in range(8):
            (docs / f"doc{i}.txt").write_text(make_text(5000, seed=i))
        data = work / "data"
        subprocess.run(
            [
                PY,
                "-m",
                "loom",
                "data",
                "prepare",
                "--input",
                str(docs),
                "--out",
                str(data),
                "--tokenizer",
                "char",
                "--val-fraction",
                "0.25",
            ],
            check=True,
            capture_output=True,
        )
        base = [
            PY,
            "-m",
            "loom",
            "train",
            f"--data.path={data}",
            f"--run.dir={work / 'runs'}",
            f"--train.steps={args.steps}",
            *TINY,
        ]
        result: dict = {
            "steps": args.steps,
            "layout": "2 hosts x 2 processes, HSDP replicate 2 x shard 2",
            "machine": "2 CPU cores, shared with other jobs",
        }
        t0 = time.monotonic()
        env1 = {k: v for k, v in env_for("slurm", 0, work).items() if not k.startswith("SLURM_")}
        subprocess.run(
            [*base, "--run.name=ref", "--parallel.dp_impl=none"], env=env1, check=True, capture_output=True
        )
        ref = curve(work / "runs" / "ref")
        result["single_process_s"] = round(time.monotonic() - t0, 1)
        with Hosts(2) as hosts:
            for scheduler in ("slurm", "pbs"):
                name = f"hsdp-{scheduler}"
                cmd = [*base, f"--run.name={name}", *HSDP, f"--train.ckpt_every={args.steps // 2}"]
                t0 = time.monotonic()
                outs = [work / f"{name}-node{i}.out" for i in (1, 2)]
                procs = [
                    hosts.popen(
                        i,
                        [
                            PY,
                            "-m",
                            "loom",
                            "launch",
                            "--nproc-per-node",
                            "2",
                            "--rdzv-timeout",
                            "120",
                            "--",
                            *cmd,
                        ],
                        env=env_for(scheduler, i - 1, work),
                        stdout=open(outs[i - 1], "w"),
                        stderr=subprocess.STDOUT,
                    )
                    for i in (1, 2)
                ]
                while any(proc.poll() is None for proc in procs) and not any(proc.poll() for proc in procs):
                    time.sleep(0.1)  # until both end, or one fails (the other would wait for it)
                if any(proc.poll() != 0 for proc in procs):
                    sys.exit(f"{scheduler} run failed:\n" + "\n".join(o.read_text()[-3000:] for o in outs))
                got = curve(work / "runs" / name)
                result[scheduler] = {
                    "max_abs_dloss": worst(got, ref),
                    "steps": len(got),
                    "wall_s": round(time.monotonic() - t0, 1),
                }
                print(f"{scheduler}: {len(got)} steps, max |dloss| vs one process = {worst(got, ref):.2e}")
            result["mpiexec"] = mpiexec_from_the_job_script(hosts, base, work, ref)
            run = work / "runs" / "hsdp-slurm"
            shutil.rmtree(run / "ckpt" / f"step_{args.steps:06d}")
            (run / "metrics.jsonl").write_text("")
            half = run / "ckpt" / f"step_{args.steps // 2:06d}"
            hosts.run(
                1,
                [
                    PY,
                    "-m",
                    "loom",
                    "train",
                    "--resume",
                    str(half),
                    "--parallel.dp_impl=none",
                    "--parallel.dp_replicate=1",
                    "--train.device=cpu",
                ],
                env=env1,
                check=True,
                capture_output=True,
            )
            got = curve(run)
            result["resume_one_host"] = {
                "from_step": args.steps // 2,
                "steps": len(got),
                "max_abs_dloss": worst(got, ref),
            }
            print(f"resumed on one host from step {args.steps // 2}: max |dloss| = {worst(got, ref):.2e}")
            result["max_restarts"] = restart_when_the_host_comes_back(hosts, base, work, ref)
            hostfile = work / "hostfile"
            hostfile.write_text("node1\nnode2\n")
            doctors = [
                hosts.popen(
                    i,
                    [PY, "-m", "loom", "doctor", "--nodes", str(hostfile), "--json"],
                    env=env1,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for i in (1, 2)
            ]
            report = json.loads(doctors[0].communicate(timeout=120)[0])
            doctors[1].wait(120)
            result["doctor_allreduce"] = report["allreduce"]
            print(f"loom doctor --nodes: {report['allreduce']}")
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
