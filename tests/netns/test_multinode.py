"""Two hosts for real: network namespaces node1 and node2, each with its own address, hostname and
/etc/hosts, and `loom launch -- loom train ...` started on each the way a Slurm step
(`srun --ntasks-per-node=1`) or PBS (`pbsdsh -u`) starts it: only the scheduler's variables differ.

Compared against: the single-process run of the same config (fp32, max |loss difference| <= 1e-5 over
30 steps, HSDP replicating across the hosts and sharding within each); the same run resumed on one host
from a checkpoint the two hosts wrote; and, when one host is killed mid-run, the other host's exit code,
the dead ranks its error names, and the processes left in any namespace (none).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import tiny_args

from loom.cli import main
from loom.metrics import read_jsonl

PY = sys.executable
STEPS = 30
TINY = tiny_args(
    {
        "model.block_size": 16,
        "train.eval_batches": 1,
        "optim.warmup_steps": 2,
        "train.sample_tokens": 8,
    }
)
HSDP = ["--parallel.dp_impl=fsdp", "--parallel.dp_replicate=2"]  # replicate across hosts, shard within
_SCHEDULER_VARS = ("SLURM_", "PBS_", "MASTER_", "OMPI_", "PMI_", "PALS_", "TORCHELASTIC_", "LOOM_REPORTED")


def train_cmd(data: Path, runs: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [
        PY,
        "-m",
        "loom",
        "train",
        f"--data.path={data}",
        f"--run.dir={runs}",
        f"--run.name={name}",
        f"--train.steps={steps}",
        *TINY,
        *extra,
    ]


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCHEDULER_VARS)}
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"  # torchrun beside this interpreter
    env["OMP_NUM_THREADS"] = "1"  # the same matmul blocking as the reference: comparable to 1e-5
    return env


def scheduler_env(
    scheduler: str, node: int, tmp_path: Path, nodes: int = 2, job: str = "4242"
) -> dict[str, str]:
    """What the scheduler puts in the environment of the one task it starts on host `node` (0-based)."""
    if scheduler == "slurm":  # srun --ntasks-per-node=1 inside an allocation of node1..nodeN
        return {
            "SLURM_JOB_ID": job,
            "SLURM_NODELIST": f"node[1-{nodes}]",
            "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS": str(nodes),
            "SLURM_STEP_ID": "0",
            "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0",
        }
    nodefile = tmp_path / f"{job}.pbs01.nodes"  # PBS repeats each host once per slot
    nodefile.write_text("".join(f"node{i}\nnode{i}\n" for i in range(1, nodes + 1)))
    return {"PBS_JOBID": f"{job}.pbs01", "PBS_NODEFILE": str(nodefile), "PBS_NODENUM": str(node)}


class Launched:
    """`loom launch` running on one host, its output in a file."""

    def __init__(self, hosts, host: int, args: list[str], env: dict[str, str], out: Path):
        self.out = out
        with open(out, "w") as f:
            self.p = hosts.popen(
                host, [PY, "-m", "loom", "launch", *args], env=env, stdout=f, stderr=subprocess.STDOUT
            )

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"loom launch still running after {timeout}s:\n{self.text()[-3000:]}"
            ) from None

    def text(self) -> str:
        return self.out.read_text()


def launch_on_hosts(
    hosts, scheduler, tmp_path, args, command, extra_env=None, nodes=(1, 2)
) -> list[Launched]:
    jobs = []
    for i in nodes:
        env = {**base_env(), **scheduler_env(scheduler, i - 1, tmp_path), **(extra_env or {}).get(i, {})}
        jobs.append(Launched(hosts, i, [*args, "--", *command], env, tmp_path / f"{scheduler}-node{i}.out"))
    return jobs


def wait_all(jobs: list[Launched], timeout: float) -> None:
    """Every host's loom launch exits 0; on the first failure (or the timeout) show every host's output."""
    deadline = time.monotonic() + timeout
    while any(job.p.poll() is None for job in jobs):
        failed = [job for job in jobs if job.p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            texts = "\n".join(
                f"--- {job.out.name} (exit {job.p.poll()}):\n{job.text()[-2500:]}" for job in jobs
            )
            raise AssertionError(
                f"{'a host failed' if failed else f'still running after {timeout}s'}:\n{texts}"
            )
        time.sleep(0.1)
    assert [job.p.returncode for job in jobs] == [0] * len(jobs), "\n".join(
        job.text()[-2500:] for job in jobs
    )


def curve(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def in_one_thread(args: list[str]) -> None:
    """`loom <args>` in this process with one thread, like the launched ranks (the same matmul blocking)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(char_data, tmp_path_factory):
    """The single-process curve."""
    runs = tmp_path_factory.mktemp("netns-ref")
    in_one_thread(train_cmd(char_data, runs, "ref", STEPS, "--parallel.dp_impl=none")[3:])
    return curve(runs / "ref")


def worst_difference(got: dict[int, float], reference: dict[int, float]) -> float:
    return max(abs(loss - reference[step]) for step, loss in got.items())


def test_two_hosts_hsdp_match_one_process_and_resume_on_one_host(hosts, reference, char_data, tmp_path):
    """Through Slurm's variables; the PBS launch trains in the kill test below, and its 30-step curve is
    compared in benchmarks/multinode_curve.py (a second full run here would cost ~25 s)."""
    scheduler = "slurm"
    runs = tmp_path / "runs"
    command = train_cmd(char_data, runs, "job", STEPS, *HSDP, "--train.ckpt_every=15")
    jobs = launch_on_hosts(
        hosts, scheduler, tmp_path, ["--nproc-per-node", "2", "--rdzv-timeout", "120"], command
    )
    wait_all(jobs, 300)
    head = jobs[0].text()
    assert "2 nodes checked in" in head and "node1 (2 proc), node2 (2 proc)" in head
    assert "rank=0/4 local=0/2 node=0/2 master=node1:" in head  # rank 0 and the store on the first host
    got = curve(runs / "job")
    assert sorted(got) == list(range(1, STEPS + 1))
    worst = worst_difference(got, reference)
    print(
        f"\n[netns] {scheduler}: 2 hosts x 2 processes (HSDP 2 x 2), {STEPS} steps: max |dloss| = {worst:.2e}"
    )
    assert worst <= 1e-5

    # Resume in one process, here (the file system is shared, as on a cluster), from the checkpoint the two
    # hosts wrote at step 15: in this process, which has torch loaded already, to save a start-up.
    shutil.rmtree(runs / "job" / "ckpt" / "step_000030")
    (runs / "job" / "metrics.jsonl").write_text("")
    step15 = runs / "job" / "ckpt" / "step_000015"
    in_one_thread(
        [
            "train",
            "--resume",
            str(step15),
            "--parallel.dp_impl=none",
            "--parallel.dp_replicate=1",
            "--train.device=cpu",
        ]
    )
    continued = curve(runs / "job")
    assert sorted(continued) == list(range(16, STEPS + 1))
    worst = worst_difference(continued, reference)
    print(f"[netns] resumed in 1 process, steps 16-{STEPS}: max |dloss| = {worst:.2e}")
    assert worst <= 1e-5


def test_killed_host_ends_the_job_on_the_other_naming_its_ranks(hosts, char_data, tmp_path):
    """Launched through PBS's variables (pbsdsh -u): the job forms and trains before node2 dies."""
    timeout_s = 5
    runs = tmp_path / "runs"
    command = train_cmd(char_data, runs, "job", 100_000, *HSDP, f"--parallel.timeout_s={timeout_s}")
    jobs = launch_on_hosts(
        hosts, "slurm", tmp_path, ["--nproc-per-node", "2", "--rdzv-timeout", "120"], command
    )
    metrics = runs / "job" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(curve(runs / "job")) >= 3):
        assert time.monotonic() < deadline and jobs[0].p.poll() is None, jobs[0].text()[-3000:]
        time.sleep(0.05)

    killed = hosts.kill(2)  # every process of node2: its loom launch, torchrun agent and both ranks
    jobs[1].p.wait(10)
    t0 = time.monotonic()
    rc = jobs[0].wait(timeout_s + 10)
    took = time.monotonic() - t0
    print(
        f"\n[netns] node2 killed ({len(killed)} processes): node1's loom launch exited {rc} after {took:.1f}s"
    )
    assert rc != 0
    text = jobs[0].text()
    assert "the connection to node2 (10.77.0.2) broke: rank(s) 2, 3 run there" in text, text[-3000:]
    assert hosts.pids() == []  # nothing left on either host


def test_pbs_job_script_runs_mpiexec_across_the_hosts(hosts, tmp_path):
    """The job script on the head node (no PBS_NODENUM): loom launch runs MPICH's mpiexec over the nodefile,
    whose proxies Hydra starts through its ssh launcher, here a stand-in that enters the host's namespace."""
    env = {
        **base_env(),
        **scheduler_env("pbs", 0, tmp_path),
        "HYDRA_LAUNCHER": "ssh",
        "HYDRA_LAUNCHER_EXEC": str(hosts.ssh),
    }
    del env["PBS_NODENUM"]
    # one write per rank: mpiexec forwards each rank's output as it comes, so pieces of lines can interleave
    show = (
        "import os, socket; e = os.environ; "
        "os.write(1, f\"rank {e['PMI_RANK']} {socket.gethostname()} {e['MASTER_ADDR']}\\n\".encode())"
    )
    r = hosts.run(
        1,
        [PY, "-m", "loom", "launch", "--nproc-per-node", "2", "--", PY, "-c", show],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mpiexec -n 4 -ppn 2 --hostfile" in r.stdout + r.stderr
    ranks = sorted(line for line in r.stdout.splitlines() if line.startswith("rank "))
    assert ranks == [
        "rank 0 node1 node1",
        "rank 1 node1 node1",
        "rank 2 node2 node1",
        "rank 3 node2 node1",
    ], r.stdout + r.stderr
    assert hosts.pids() == []
