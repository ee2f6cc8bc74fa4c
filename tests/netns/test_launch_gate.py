"""Bad multi-node input, on two network-namespace hosts: each mistake ends `loom launch` on every node with
one error that names the node and says what to do, within the rendezvous timeout, before torchrun starts.

Compared against: the message each mistake must produce (wrong MASTER_ADDR, a host in the nodefile that
is down, different loom versions, a different --nproc-per-node on one node, the port taken on the head).
"""

from __future__ import annotations

import subprocess
import time

import pytest
from test_multinode import PY, Launched, base_env, scheduler_env

from loom.env import port_from_job_id

TIMEOUT = 2  # --rdzv-timeout where a node must wait it out (nobody answers): the time the test costs
ARRIVE = (
    30  # where every node checks in: the verdict comes as soon as they have, so a slow start is no failure
)


def launch(
    hosts, tmp_path, scheduler="slurm", args=None, env=None, nodes=(1, 2), node_count=2, timeout=TIMEOUT
):
    jobs = {}
    for i in nodes:
        job_env = {
            **base_env(),
            **scheduler_env(scheduler, i - 1, tmp_path, nodes=node_count),
            **(env or {}).get(i, {}),
        }
        job_args = ["--rdzv-timeout", str(timeout), *(args or {}).get(i, ["--nproc-per-node", "2"])]
        jobs[i] = Launched(hosts, i, [*job_args, "--", "true"], job_env, tmp_path / f"node{i}.out")
    for job in jobs.values():
        assert job.wait(timeout + 30) == 2, job.text()  # 2: a LoomError, printed without a traceback
    return {i: job.text() for i, job in jobs.items()}


CASES = {
    "master-addr-loopback": dict(
        env={1: {"MASTER_ADDR": "localhost"}, 2: {"MASTER_ADDR": "localhost"}},
        expect={
            1: "MASTER_ADDR=localhost is a loopback address (127.0.0.1) on node1: the other 1 node(s) "
            "cannot reach it",
            2: "node2 (node 1) could not reach the rendezvous MASTER_ADDR=localhost port",
        },
    ),
    "master-addr-not-the-head": dict(
        env={1: {"MASTER_ADDR": "node2"}, 2: {"MASTER_ADDR": "node2"}},
        expect={
            1: "MASTER_ADDR=node2 (10.77.0.2) is not an address of node1, the head node",
            2: "the allocation's first host is node1",
        },
    ),
    "loom-versions-differ": dict(
        env={2: {"LOOM_REPORTED_VERSION": "0.0.9"}},
        timeout=ARRIVE,
        expect={1: "loom versions differ: node1 0.1.0, node2 0.0.9", 2: "loom versions differ"},
    ),
    "nproc-differs": dict(
        args={2: ["--nproc-per-node", "1"]},
        timeout=ARRIVE,
        expect={1: "processes per node differ: node1 2, node2 1", 2: "same --nproc-per-node"},
    ),
    "host-down": dict(
        scheduler="pbs",
        node_count=3,  # node3 is in the nodefile and /etc/hosts, but nothing answers at 10.77.0.3
        expect={1: "no word from node3 (node 2) within 2s", 2: "no word from node3 (node 2)"},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_multinode_input_is_named_on_every_node(hosts, tmp_path, case):
    spec = dict(CASES[case])
    expect = spec.pop("expect")
    t0 = time.monotonic()
    out = launch(hosts, tmp_path, **spec)
    print(f"\n[netns] {case}: both nodes exited 2 after {time.monotonic() - t0:.1f}s")
    for i, text in expect.items():
        assert text in out[i], out[i]
        assert "hint:" in out[i] and "torchrun --nnodes" not in out[i]  # stopped before torchrun
    assert hosts.pids() == []


def test_port_in_use_on_the_head(hosts, tmp_path):
    port = port_from_job_id("4242")
    holder = hosts.popen(
        1,
        [
            PY,
            "-c",
            f"import socket,time; s=socket.socket(); s.bind(('0.0.0.0', {port})); "
            "s.listen(); print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "up\n"
    out = launch(hosts, tmp_path, nodes=(1,))
    assert f"port {port} is already in use on the head node node1" in out[1]
    assert "pass --port P, the same on every node, or set MASTER_PORT" in out[1]
    holder.kill()
    holder.wait()


def doctor_on_hosts(hosts, tmp_path, *args, env=None):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1\nnode2\n")
    cmd = [PY, "-m", "loom", "doctor", "--nodes", str(hostfile), "--timeout", str(TIMEOUT), *args]
    procs = [
        hosts.popen(
            i,
            cmd,
            env={**base_env(), **(env or {}).get(i, {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (1, 2)
    ]
    return [(p.wait(60), p.stdout.read()) for p in procs]


def test_doctor_nodes_checks_the_hosts_and_measures_the_all_reduce(hosts, tmp_path):
    (rc1, head), (rc2, other) = doctor_on_hosts(hosts, tmp_path, "--timeout", "30")
    assert (rc1, rc2) == (0, 0), head + other
    print("\n" + head)
    assert "2 host(s) checked in at node1:" in head and "node 1 node2: loom 0.1.0" in head
    assert "all-reduce of 4.0 MiB between the hosts" in head and "GB/s" in head
    assert "checked in with node1:" in other


def test_doctor_nodes_finds_a_wrong_master_addr_and_a_version_mismatch(hosts, tmp_path):
    (rc1, head), (rc2, other) = doctor_on_hosts(hosts, tmp_path, "--master-addr", "10.77.0.9")
    assert (rc1, rc2) == (2, 2)
    assert "MASTER_ADDR=10.77.0.9 (10.77.0.9) is not an address of node1, the head node" in head
    assert "hint: unset MASTER_ADDR to use the allocation's first host (node1)" in head
    assert "node2 (node 1) could not reach the rendezvous MASTER_ADDR=10.77.0.9" in other
    mismatch = {1: {"LOOM_REPORTED_VERSION": "0.2.0"}}
    (rc1, head), (rc2, other) = doctor_on_hosts(hosts, tmp_path, "--timeout", str(ARRIVE), env=mismatch)
    assert (rc1, rc2) == (2, 2)
    for text in (head, other):
        assert "loom versions differ: node1 0.2.0, node2 0.1.0" in text
        assert "install the same loom on every node" in text
