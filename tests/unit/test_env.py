"""`loom.env.detect_env` against the environments real launchers set.

Each case is the set of variables a launcher gives one process (torchrun, Open MPI, MPICH Hydra as
recorded from `mpiexec -n 2 env`, Cray PALS on a PBS machine, srun, a PBS job script), compared with
the `DistEnv` that process should see. Also: Slurm host lists, PBS nodefiles, ports.
"""

from __future__ import annotations

import socket

import pytest

from loom.env import (
    DEFAULT_MASTER_PORT,
    DistEnv,
    detect_env,
    expand_hostlist,
    free_port,
    parse_tasks_per_node,
    port_from_job_id,
    read_hostfile,
    restart_count,
)
from loom.errors import LoomError


@pytest.fixture
def nodefile(tmp_path):
    """A PBS nodefile for 2 hosts with 4 MPI slots each: PBS lists each host once per slot."""
    path = tmp_path / "nodefile"
    path.write_text("x3005c0s7b0n0.hsn\n" * 4 + "x3005c0s7b1n0.hsn\n" * 4)
    return path


# ----------------------------------------------------------------------------------------- launchers


def test_torchrun_second_node():
    env = {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "node-a",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "job7",
    }
    assert detect_env(env) == DistEnv(6, 2, 8, 4, 1, 2, "node-a", 29400, "torchrun")


def test_torchrun_wins_over_slurm_when_torchrun_runs_inside_srun():
    # srun --ntasks-per-node=1 torchrun ...: each worker sees its own torchrun rank and the srun task's.
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "nid001",
        "MASTER_PORT": "29500",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "nid[001-002]",
    }
    got = detect_env(env)
    assert got.source == "torchrun"
    assert (got.rank, got.local_rank, got.world_size, got.node_rank, got.num_nodes) == (5, 1, 8, 1, 2)


def test_hand_set_env_rendezvous_defaults_to_one_node():
    got = detect_env({"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert got == DistEnv(1, 1, 3, 3, 0, 1, "10.0.0.1", 1234, "torchrun")


def test_openmpi_node_index_from_block_layout_not_node_rank(nodefile):
    # Open MPI documents OMPI_COMM_WORLD_NODE_RANK as the rank on the node across jobs (here 2),
    # not the node's index (1).
    env = {
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "OMPI_COMM_WORLD_NODE_RANK": "2",
        "PBS_JOBID": "1234.pbs01",
        "PBS_NODEFILE": str(nodefile),
    }
    got = detect_env(env)
    assert got == DistEnv(6, 2, 8, 4, 1, 2, "x3005c0s7b0n0.hsn", port_from_job_id("1234.pbs01"), "openmpi")


def test_mpich_hydra_recorded_environment():
    # From `mpiexec -n 2 -ppn 2 --hostfile hf env` with MPICH 5 (Hydra); rank 1 of 2 on one host.
    env = {
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "PMI_FD": "9",
        "PMI_HOSTNAME": "localhost",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
    }
    assert detect_env(env) == DistEnv(1, 1, 2, 2, 0, 1, "127.0.0.1", DEFAULT_MASTER_PORT, "mpich/pmi")


def test_mpich_multi_node_block_layout():
    env = {"PMI_RANK": "9", "PMI_SIZE": "12", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
    got = detect_env(env)
    assert (got.node_rank, got.num_nodes, got.local_rank) == (2, 3, 1)


def test_cray_pals_on_polaris(nodefile):
    # mpiexec -n 8 --ppn 4 under PBS on Polaris: PALS_* plus Cray PMI's PMI_* variables.
    env = {
        "PALS_RANKID": "5",
        "PALS_LOCAL_RANKID": "1",
        "PALS_NODEID": "1",
        "PALS_APID": "abc",
        "PMI_RANK": "5",
        "PMI_SIZE": "8",
        "PMI_LOCAL_RANK": "1",
        "PMI_LOCAL_SIZE": "4",
        "PBS_JOBID": "98765.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov",
        "PBS_NODEFILE": str(nodefile),
    }
    got = detect_env(env)
    assert got == DistEnv(5, 1, 8, 4, 1, 2, "x3005c0s7b0n0.hsn", port_from_job_id("98765"), "mpich/pmi")


def test_pals_rank_variables_alone_are_enough_with_a_size():
    env = {"PALS_RANKID": "3", "PALS_LOCAL_RANKID": "3", "PALS_LOCAL_SIZE": "4", "PMI_SIZE": "4"}
    got = detect_env(env)
    assert (got.rank, got.local_rank, got.local_world_size, got.source) == (3, 3, 4, "mpich/pmi")


def test_pmix_rank_under_srun_defers_to_slurm():
    # srun --mpi=pmix sets PMIX_RANK but no size; the Slurm step describes the job.
    env = {
        "PMIX_RANK": "3",
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
    }
    assert detect_env(env) == DistEnv(3, 1, 4, 2, 1, 2, "gpu07", port_from_job_id("77"), "slurm")


def test_slurm_srun_step():
    # srun --nodes 2 --ntasks-per-node 4 inside sbatch: task 5 on the second node.
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NODELIST": "nid[001-002]",
        "SLURM_JOB_NODELIST": "nid[001-002]",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_TASKS_PER_NODE": "4(x2)",
    }
    got = detect_env(env)
    assert got == DistEnv(5, 1, 8, 4, 1, 2, "nid001", port_from_job_id("123456"), "slurm")
    assert 20000 <= got.master_port < 40000


def test_slurm_zero_nodes_is_refused():
    """Issue 42 item 9: SLURM_NNODES=0 divided the tasks by zero (a ZeroDivisionError traceback)."""
    env = {
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "0",
    }
    with pytest.raises(LoomError, match="SLURM_NNODES='0' is not a node count"):
        detect_env(env)


def test_slurm_uneven_tasks_per_node():
    env = {
        "SLURM_STEP_ID": "1",
        "SLURM_PROCID": "8",
        "SLURM_NTASKS": "10",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "2",
        "SLURM_NNODES": "3",
        "SLURM_TASKS_PER_NODE": "4(x2),2",
        "SLURM_JOB_NODELIST": "a[1-3]",
    }
    got = detect_env(env)
    assert (got.local_world_size, got.node_rank, got.master_addr) == (2, 2, "a1")


def test_slurm_batch_script_is_one_process_not_rank_0_of_n():
    # The batch script sees SLURM_PROCID=0 and the job's SLURM_NTASKS but no step id: it is alone.
    env = {
        "SLURM_JOB_ID": "99",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "nid[001-002]",
    }
    got = detect_env(env)
    assert (got.world_size, got.source) == (1, "none")


def test_pbs_job_script_reads_nodefile(nodefile):
    got = detect_env({"PBS_JOBID": "4321.pbs", "PBS_NODEFILE": str(nodefile)})
    assert got == DistEnv(0, 0, 1, 1, 0, 1, "x3005c0s7b0n0.hsn", port_from_job_id("4321"), "pbs")


def test_pbs_nodefile_unreadable_on_this_node_falls_back(tmp_path):
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "PBS_JOBID": "5.pbs", "PBS_NODEFILE": str(tmp_path / "absent")}
    assert detect_env(env).master_addr == "127.0.0.1"


def test_nothing_set_is_a_single_process():
    assert detect_env({}) == DistEnv(0, 0, 1, 1, 0, 1, "127.0.0.1", DEFAULT_MASTER_PORT, "none")


def test_master_variables_override_every_source():
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "31000"}
    got = detect_env(env)
    assert (got.master_addr, got.master_port) == ("head", 31000)


def test_reads_os_environ_by_default(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "29501")
    got = detect_env()
    assert (got.rank, got.world_size, got.master_port, got.source) == (2, 4, 29501, "torchrun")


def test_str_is_readable():
    text = str(DistEnv(1, 1, 2, 2, 0, 1, "h", 5, "torchrun"))
    assert text == "rank=1/2 local=1/2 node=0/1 master=h:5 (torchrun)"


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 outside world size 4"),
        ({"RANK": "one", "WORLD_SIZE": "4"}, "RANK='one'"),
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_PORT": "70000"}, "master port 70000"),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "local rank 2",
        ),
    ],
)
def test_inconsistent_environment_is_a_user_error(env, fragment):
    with pytest.raises(LoomError) as info:
        detect_env(env)
    assert fragment in str(info.value)
    assert info.value.hint


# ------------------------------------------------------------------------------------ host lists, ports


@pytest.mark.parametrize(
    "hostlist, expected",
    [
        ("nid[001-003,007],gpu5", ["nid001", "nid002", "nid003", "nid007", "gpu5"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a1,b2, c3", ["a1", "b2", "c3"]),
        ("x1000c0s0b0n[0-1]", ["x1000c0s0b0n0", "x1000c0s0b0n1"]),
        ("single", ["single"]),
        ("gpu[9-10]", ["gpu9", "gpu10"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("bad", ["nid[001-", "nid[3-1]", "nid[a-b]", "nid]1["])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(LoomError):
        expand_hostlist(bad)


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("4(x2),2") == [4, 4, 2]
    assert parse_tasks_per_node("8") == [8]
    with pytest.raises(LoomError):
        parse_tasks_per_node("4x2")


def test_read_hostfile_formats(tmp_path, nodefile):
    assert read_hostfile(nodefile) == ["x3005c0s7b0n0.hsn", "x3005c0s7b1n0.hsn"]
    mixed = tmp_path / "hosts"
    mixed.write_text("# comment\nh1:4\n\nh2 slots=4\nh1\n")
    assert read_hostfile(mixed) == ["h1", "h2"]


def test_read_hostfile_missing_or_empty(tmp_path):
    with pytest.raises(LoomError, match="cannot read host file"):
        read_hostfile(tmp_path / "absent")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(LoomError, match="lists no hosts"):
        read_hostfile(empty)


def test_port_from_job_id_is_deterministic_and_in_range():
    assert port_from_job_id("123456.pbs01") == port_from_job_id("123456")
    assert port_from_job_id("1") != port_from_job_id("2")
    assert all(20000 <= port_from_job_id(str(j)) < 40000 for j in (0, 19999, 20000, 10**12))
    assert port_from_job_id(None) == port_from_job_id("no-digits") == DEFAULT_MASTER_PORT


def test_free_port_can_be_bound():
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))  # raises if the port were not free


def test_restart_count_from_torch_elastic():
    assert restart_count({}) == 0  # first attempt, or another launcher
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": ""}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "0"}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
