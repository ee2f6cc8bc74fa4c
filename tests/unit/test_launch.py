"""`loom launch`: scheduler detection and the command lines built for each cluster.

Compared against the commands one would type by hand on each kind of machine (a PBS job on 2 hosts ×
4 GPUs as on Polaris, a 2-node Slurm job, a workstation). Nothing is launched: `subprocess.run` is
replaced where the running path is tested.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

import loom.launch as launch
from loom.env import port_from_job_id
from loom.errors import LoomError
from loom.launch import launch_main, plan_command
from loom.launch.commands import (
    build_command,
    detect_mpi_flavour,
    mpiexec_command,
    parse_mpi_flavour,
    resolve_launcher,
    srun_command,
    torchrun_command,
)
from loom.launch.detect import Allocation, count_local_gpus, default_nproc_per_node, detect_allocation

TRAIN = ["loom", "train", "configs/tiny.toml", "--model.n_layer=2"]

_SCHEDULER_VARS = ("SLURM_", "PBS_", "MASTER_", "OMPI_", "PMI_", "PALS_")


@pytest.fixture
def pbs_env(tmp_path):
    """A PBS job on 2 hosts with 4 slots each: the nodefile repeats each host once per slot."""
    nodefile = tmp_path / "aux" / "98765.pbs01"
    nodefile.parent.mkdir()
    nodefile.write_text("x3005c0s7b0n0\n" * 4 + "x3005c0s7b1n0\n" * 4)
    return {"PBS_JOBID": "98765.pbs01", "PBS_NODEFILE": str(nodefile)}


@pytest.fixture
def slurm_env():
    """An sbatch script of a 2-node job, 4 GPUs per node."""
    return {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "nid[001-002]",
        "SLURM_NNODES": "2",
        "SLURM_PROCID": "0",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    }


@pytest.fixture
def clean_os_environ(monkeypatch):
    """os.environ without any scheduler, for the tests that go through launch_main."""
    import os

    for name in list(os.environ):
        if name.startswith(_SCHEDULER_VARS):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    return monkeypatch


# ------------------------------------------------------------------------------------------- detection


def test_detect_pbs_allocation(pbs_env):
    alloc = detect_allocation(pbs_env)
    assert alloc == Allocation(
        "pbs", ("x3005c0s7b0n0", "x3005c0s7b1n0"), "98765.pbs01", pbs_env["PBS_NODEFILE"]
    )
    assert (alloc.num_nodes, alloc.head) == (2, "x3005c0s7b0n0")


def test_detect_slurm_allocation(slurm_env):
    alloc = detect_allocation(slurm_env)
    assert (alloc.scheduler, alloc.hosts, alloc.job_id, alloc.hostfile) == (
        "slurm",
        ("nid001", "nid002"),
        "123456",
        None,
    )


def test_detect_explicit_hostfile_wins_and_none_without_anything(tmp_path, slurm_env):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 slots=8\nh2 slots=8\n")
    alloc = detect_allocation(slurm_env, hostfile=str(hostfile))
    assert (alloc.scheduler, alloc.hosts) == ("hostfile", ("h1", "h2"))
    none = detect_allocation({})
    assert (none.scheduler, none.num_nodes, none.head) == ("none", 1, None)


def test_slurm_job_id_without_nodelist_is_not_an_allocation():
    assert detect_allocation({"SLURM_JOB_ID": "5"}).scheduler == "none"


def test_count_gpus_without_torch(tmp_path):
    assert count_local_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    assert count_local_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert count_local_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == 0
    assert count_local_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8a3e,GPU-77f1"}) == 2
    for name in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-uvm", "nvme0"):
        (tmp_path / name).touch()
    assert count_local_gpus({}, dev_dir=tmp_path) == 3
    assert count_local_gpus({}, dev_dir=tmp_path / "absent") == 0
    assert default_nproc_per_node({}, dev_dir=tmp_path / "absent") == 1


# ------------------------------------------------------------------------------------ builders, by site


def test_pbs_two_hosts_four_gpus_uses_mpiexec(pbs_env):
    cmd = plan_command(["--mpi-flavour", "mpich", "--nproc-per-node", "4", "--", *TRAIN], pbs_env)
    port = port_from_job_id("98765")
    assert cmd == [
        "mpiexec",
        "-n",
        "8",
        "-ppn",
        "4",
        "--hostfile",
        pbs_env["PBS_NODEFILE"],
        "env",
        "MASTER_ADDR=x3005c0s7b0n0",
        f"MASTER_PORT={port}",
        *TRAIN,
    ]


def test_pbs_torchrun_runs_one_torchrun_per_host_through_mpiexec(pbs_env):
    argv = ["--launcher", "torchrun", "--mpi-flavour", "mpich", "--nproc-per-node", "4", "--", *TRAIN]
    cmd = plan_command(argv, pbs_env)
    port = port_from_job_id("98765")
    assert cmd == [
        "mpiexec",
        "-n",
        "2",
        "-ppn",
        "1",
        "--hostfile",
        pbs_env["PBS_NODEFILE"],
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"x3005c0s7b0n0:{port}",
        "--rdzv-id",
        "98765.pbs01",
        "--no-python",
        *TRAIN,
    ]


def test_openmpi_flavour_and_root_flags():
    cmd = mpiexec_command(TRAIN, nnodes=2, nproc_per_node=4, hostfile="hf", flavour="openmpi", as_root=True)
    assert cmd[:8] == ["mpiexec", "-np", "8", "-npernode", "4", "--hostfile", "hf", "--allow-run-as-root"]
    assert "--oversubscribe" in cmd and cmd[-len(TRAIN) :] == TRAIN
    assert "--allow-run-as-root" not in mpiexec_command(TRAIN, nnodes=1, nproc_per_node=2, flavour="openmpi")
    assert "--allow-run-as-root" not in mpiexec_command(TRAIN, nnodes=1, nproc_per_node=2, as_root=True)


def test_slurm_two_nodes_uses_srun(slurm_env):
    cmd = plan_command(["--", *TRAIN], slurm_env)
    port = port_from_job_id("123456")
    assert cmd == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "8",
        "--ntasks-per-node",
        "4",
        "env",
        f"MASTER_PORT={port}",
        *TRAIN,
    ]


def test_slurm_torchrun_is_wrapped_in_one_srun_task_per_node(slurm_env):
    cmd = plan_command(["--launcher", "torchrun", "--port", "29600", "--", *TRAIN], slurm_env)
    assert cmd == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "2",
        "--ntasks-per-node",
        "1",
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "nid001:29600",
        "--rdzv-id",
        "123456",
        "--no-python",
        *TRAIN,
    ]


def test_slurm_part_of_the_allocation_pins_the_nodelist(slurm_env):
    cmd = plan_command(["--launcher", "torchrun", "--nnodes", "1", "--", *TRAIN], slurm_env)
    assert cmd[:8] == ["srun", "--nodes", "1", "--ntasks", "1", "--ntasks-per-node", "1", "--nodelist"]
    assert cmd[8] == "nid001"
    assert cmd[9:14] == ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node"]


def test_slurm_mpiexec_lets_mpi_read_the_allocation(slurm_env):
    cmd = plan_command(["--launcher", "mpiexec", "--mpi-flavour", "mpich", "--", *TRAIN], slurm_env)
    assert cmd[:5] == ["mpiexec", "-n", "8", "-ppn", "4"]
    assert "--hostfile" not in cmd and not any(a.startswith("MASTER_ADDR=") for a in cmd)


def test_no_scheduler_uses_torchrun_standalone():
    cmd = plan_command(["--", *TRAIN], {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert cmd == [
        "torchrun",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--no-python",
        *TRAIN,
    ]


def test_no_scheduler_without_gpus_runs_one_process():
    cmd = plan_command(["--", *TRAIN], {"CUDA_VISIBLE_DEVICES": ""})
    assert cmd[cmd.index("--nproc-per-node") + 1] == "1"


def test_python_script_goes_to_torchrun_without_no_python():
    cmd = torchrun_command(["train.py", "--x=1"], nnodes=1, nproc_per_node=2)
    assert "--no-python" not in cmd and cmd[-2:] == ["train.py", "--x=1"]


def test_no_scheduler_several_nodes_with_a_head_address():
    argv = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--master-addr",
        "10.1.0.5",
        "--port",
        "29500",
        "--",
        *TRAIN,
    ]
    cmd = plan_command(argv, {})
    assert cmd[:10] == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.1.0.5:29500",
        "--rdzv-id",
    ]


def test_hostfile_defaults_to_mpiexec_over_its_hosts(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1:4\nh2:4\nh3:4\n")
    cmd = plan_command(
        ["--hostfile", str(hostfile), "--mpi-flavour", "mpich", "--port", "30000", "--", *TRAIN],
        {"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
    )
    assert cmd[:7] == ["mpiexec", "-n", "12", "-ppn", "4", "--hostfile", str(hostfile)]
    assert cmd[7:10] == ["env", "MASTER_ADDR=h1", "MASTER_PORT=30000"]


def test_srun_builder_and_resolution_table():
    assert srun_command(["a"], nnodes=3, nproc_per_node=2) == [
        "srun",
        "--nodes",
        "3",
        "--ntasks",
        "6",
        "--ntasks-per-node",
        "2",
        "a",
    ]
    table = {s: resolve_launcher("auto", s) for s in ("slurm", "pbs", "hostfile", "none")}
    assert table == {"slurm": "srun", "pbs": "mpiexec", "hostfile": "mpiexec", "none": "torchrun"}
    assert resolve_launcher("srun", "pbs") == "srun"


@pytest.mark.parametrize(
    "text, flavour",
    [
        ("mpiexec (OpenRTE) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/", "openmpi"),
        ("mpirun (Open MPI) 5.0.3\n", "openmpi"),
        ("HYDRA build details:\n    Version:   5.0.2\n", "mpich"),
        ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "mpich"),
    ],
)
def test_parse_mpi_flavour(text, flavour):
    assert parse_mpi_flavour(text) == flavour


def test_detect_mpi_flavour_runs_version(tmp_path, monkeypatch):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.3'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_mpi_flavour() == "openmpi"
    with pytest.raises(LoomError, match="not found") as info:
        detect_mpi_flavour("no-such-mpiexec")
    assert "--launcher torchrun" in info.value.hint


# ----------------------------------------------------------------------------------------- launch_main


def test_dry_run_prints_the_command(clean_os_environ, capsys):
    assert launch_main(["--dry-run", "--", *TRAIN]) == 0
    out = capsys.readouterr().out
    assert (
        out
        == shlex.join(
            ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--no-python", *TRAIN]
        )
        + "\n"
    )


def test_dry_run_under_pbs(clean_os_environ, capsys, pbs_env):
    for name, value in pbs_env.items():
        clean_os_environ.setenv(name, value)
    assert launch_main(["--dry-run", "--mpi-flavour", "mpich", "--nproc-per-node", "4", "--", *TRAIN]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[:7] == ["mpiexec", "-n", "8", "-ppn", "4", "--hostfile", pbs_env["PBS_NODEFILE"]]
    assert words[-len(TRAIN) :] == TRAIN


def test_launch_runs_the_command_and_returns_its_exit_code(clean_os_environ, monkeypatch):
    seen = []

    def fake_run(cmd, check):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 7)

    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    assert launch_main(["--nproc-per-node", "3", "--", *TRAIN]) == 7
    assert seen == [
        ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "3", "--no-python", *TRAIN]
    ]
    monkeypatch.setattr(launch.subprocess, "run", lambda cmd, check: subprocess.CompletedProcess(cmd, -9))
    assert launch_main(["--", *TRAIN]) == 128 + 9


def test_launcher_missing_on_path_is_a_user_error(clean_os_environ, monkeypatch):
    def missing(cmd, check):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(launch.subprocess, "run", missing)
    with pytest.raises(LoomError, match="torchrun not found"):
        launch_main(["--", *TRAIN])


def test_help_returns_zero(capsys):
    assert launch_main(["--help"]) == 0
    assert "--nproc-per-node" in capsys.readouterr().out


def test_launch_never_imports_torch():
    code = "import sys, loom.launch, loom.env; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--dry-run", "loom", "train"], "put it after --"),
        (["--dry-run", "--"], "nothing after --"),
        (["--launcher", "pdsh", "--", *TRAIN], "unknown launcher 'pdsh'"),
        (["--nnodes", "0", "--", *TRAIN], "at least 1"),
        (["--nproc-per-node", "0", "--", *TRAIN], "at least 1"),
        (["--nproc-per-node", "four", "--", *TRAIN], "invalid int value"),
        (["--port", "70000", "--", *TRAIN], "not a TCP port"),
        (["--mpi-flavour", "lam", "--launcher", "mpiexec", "--", *TRAIN], "unknown --mpi-flavour"),
        (["--nnodes", "2", "--", *TRAIN], "needs the head node's address"),
        (
            ["--launcher", "mpiexec", "--mpi-flavour", "mpich", "--nnodes", "2", "--", *TRAIN],
            "needs a hostfile",
        ),
    ],
)
def test_bad_input_is_a_loom_error_with_a_hint(argv, fragment):
    with pytest.raises(LoomError) as info:
        plan_command(argv, {"CUDA_VISIBLE_DEVICES": "0"})
    assert fragment in info.value.message
    assert info.value.hint


def test_missing_or_empty_hostfile(tmp_path):
    with pytest.raises(LoomError, match="cannot read host file") as info:
        plan_command(["--hostfile", str(tmp_path / "nope"), "--", *TRAIN], {})
    assert "--hostfile" in info.value.hint
    empty = tmp_path / "empty"
    empty.write_text("\n# no hosts yet\n")
    with pytest.raises(LoomError, match="lists no hosts"):
        plan_command(["--hostfile", str(empty), "--", *TRAIN], {})


def test_hints_name_the_option_or_variable_the_value_came_from(tmp_path):
    """A missing PBS nodefile is PBS_NODEFILE's problem, not --hostfile's; a bad MASTER_PORT is not --port;
    one bad count is named alone."""
    with pytest.raises(LoomError, match=r"cannot read host file .*nope' \(PBS_NODEFILE\)") as info:
        plan_command(["--", *TRAIN], {"PBS_NODEFILE": str(tmp_path / "nope"), "PBS_JOBID": "1.pbs"})
    assert "PBS_NODEFILE" in info.value.hint and "to --hostfile" not in info.value.hint
    with pytest.raises(LoomError, match="^MASTER_PORT 99999 is not a TCP port") as info:
        plan_command(["--", *TRAIN], {"MASTER_PORT": "99999", "CUDA_VISIBLE_DEVICES": "0"})
    assert "MASTER_PORT" in info.value.hint
    with pytest.raises(LoomError, match="^--nnodes must be at least 1, got 0\n"):
        plan_command(["--nnodes", "0", "--", *TRAIN], {"CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(LoomError, match="^--max-restarts must be >= 0, got -1\n"):
        plan_command(["--max-restarts", "-1", "--", *TRAIN], {"CUDA_VISIBLE_DEVICES": "0"})
    from loom.doctor import nodes_check

    with pytest.raises(LoomError, match=r"\(--nodes\)") as info:  # loom doctor takes --nodes, not --hostfile
        nodes_check(str(tmp_path / "nope"))
    assert "--nodes" in info.value.hint and "--hostfile" not in info.value.hint


def test_more_nodes_than_the_allocation(slurm_env):
    with pytest.raises(LoomError, match="asked for 3 nodes") as info:
        plan_command(["--nnodes", "3", "--", *TRAIN], slurm_env)
    assert "--nnodes 2" in info.value.hint


def test_builders_reject_bad_counts_and_empty_commands():
    with pytest.raises(LoomError, match="at least one node"):
        build_command("torchrun", TRAIN, nnodes=1, nproc_per_node=0)
    with pytest.raises(LoomError, match="no command"):
        srun_command([], nnodes=1, nproc_per_node=1)
    with pytest.raises(LoomError, match="unknown MPI flavour"):
        mpiexec_command(TRAIN, nnodes=1, nproc_per_node=1, flavour="lam")
    with pytest.raises(LoomError, match="needs the head node"):
        torchrun_command(TRAIN, nnodes=2, nproc_per_node=1)


# ------------------------------------------------------------------- loom launch on every node (issue 18)


def test_inside_a_slurm_step_each_node_runs_its_own_torchrun(slurm_env):
    """`srun --ntasks-per-node=1 loom launch -- ...`: no second srun; node 0 serves the rendezvous."""
    port = port_from_job_id("123456")
    for node in (0, 1):
        step = {**slurm_env, "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"}
        cmd = plan_command(["--rdzv-timeout", "120", "--max-restarts", "2", "--", *TRAIN], step)
        assert cmd == [
            "env",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",  # or a node that comes back never rejoins
            "torchrun",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "4",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"nid001:{port}",
            "--rdzv-id",
            "123456",
            "--rdzv-conf",
            f"is_host={int(node == 0)},join_timeout=120",
            "--max-restarts",
            "2",
            "--no-python",
            *TRAIN,
        ]


def test_under_pbsdsh_each_node_runs_its_own_torchrun(pbs_env):
    cmd = plan_command(["--nproc-per-node", "4", "--", *TRAIN], {**pbs_env, "PBS_NODENUM": "1"})
    port = port_from_job_id("98765")
    assert cmd[:10] == [
        "torchrun",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"x3005c0s7b0n0:{port}",
        "--rdzv-id",
    ]
    assert cmd[cmd.index("--rdzv-conf") + 1] == "is_host=0,join_timeout=600"


def test_node_detection_and_its_refusals(slurm_env):
    from loom.launch.detect import node_task

    assert node_task(slurm_env) is None  # the batch script: one process, not a step
    step = {**slurm_env, "SLURM_STEP_ID": "3", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2"}
    assert node_task(step) == (1, 2)
    subset = {
        **step,
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "nid[007-008]",
        "SLURM_JOB_NODELIST": "nid[001-008]",
    }
    assert "nid007:" in plan_command(["--", *TRAIN], subset)[8]  # the step's first node, not the job's
    with pytest.raises(LoomError, match="several tasks on this node") as info:
        node_task({**step, "SLURM_LOCALID": "1"})
    assert "--ntasks-per-node=1" in info.value.hint
    with pytest.raises(LoomError, match="--launcher srun on every node"):
        plan_command(["--launcher", "srun", "--", *TRAIN], step)
    with pytest.raises(LoomError, match="node index 5 is outside the 2 node"):
        plan_command(["--node-rank", "5", "--", *TRAIN], slurm_env)
    manual = plan_command(
        ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--port", "29601", "--", *TRAIN],
        {"CUDA_VISIBLE_DEVICES": "0"},
    )
    assert (
        manual[manual.index("--rdzv-endpoint") + 1] == "h0:29601" and "is_host=0,join_timeout=600" in manual
    )


def _hello(node, host, loom="0.1.0", nproc=2):
    from loom.launch.gate import Hello

    return Hello(node=node, host=host, loom=loom, torch="2.13.0+cpu", python="3.11.7", nproc=nproc)


def test_gate_names_each_mismatch_and_each_missing_node():
    from loom.launch.gate import _verdict, mismatches

    same = [_hello(0, "a"), _hello(1, "b")]
    assert mismatches(same) == [] and _verdict(same, 2, "a", 1, 5, ("a", "b")) is None
    odd = [_hello(1, "b", loom="0.2.0", nproc=1), _hello(0, "a")]
    assert mismatches(odd) == [
        "loom versions differ: a 0.1.0, b 0.2.0",
        "processes per node differ: a 2, b 1",
    ]
    err = _verdict(odd, 2, "a", 1, 5, ("a", "b"))
    assert "install the same loom on every node" in err.hint and "--nproc-per-node" in err.hint
    missing = _verdict(same, 4, "a", 29500, 5, ("a", "b", "c", "d"))
    assert missing.message.startswith(
        "no word from c (node 2), d (node 3) within 5s at the rendezvous a:29500"
    )


def test_gate_node_tells_a_running_job_from_the_gate(monkeypatch):
    """A port that answers without the gate's greeting: an error, or with --max-restarts a job to rejoin."""
    import socket
    import threading

    from loom.launch import gate

    monkeypatch.setattr(gate, "_BANNER_WAIT_S", 0.2)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: [server.accept() for _ in range(2)], daemon=True).start()
    with pytest.raises(LoomError, match="answers, but not as loom launch on the head node") as info:
        gate.node_gate("127.0.0.1", port, _hello(1, "b"), timeout=5)
    assert "--port P" in info.value.hint
    gate.node_gate("127.0.0.1", port, _hello(1, "b"), timeout=5, rejoin=True)  # joins, no error
    server.close()
    with pytest.raises(LoomError, match=r"b \(node 1\) could not reach the rendezvous MASTER_ADDR=127.0.0.1"):
        gate.node_gate("127.0.0.1", port, _hello(1, "b"), timeout=0.3, hosts=("a", "b"))


def test_gate_hints_name_the_command_that_runs_it(monkeypatch):
    """Under loom doctor --nodes the gate's hints told the user to start loom launch and to pass
    --max-restarts, which doctor does not take."""
    import socket
    import threading

    from loom.launch import gate

    monkeypatch.setattr(gate, "_BANNER_WAIT_S", 0.2)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=server.accept, daemon=True).start()
    with pytest.raises(LoomError, match="answers, but not as loom doctor --nodes on the head node") as info:
        gate.node_gate("127.0.0.1", port, _hello(1, "b"), timeout=5, command="loom doctor --nodes")
    assert "--max-restarts" not in info.value.hint and "--port P" in info.value.hint
    server.close()
    missing = gate._verdict([_hello(0, "a")], 2, "a", 29500, 5, ("a", "b"), "loom doctor --nodes")
    assert (
        missing.hint.startswith("start loom doctor --nodes on every node")
        and "loom launch" not in missing.hint
    )


def test_a_broken_connection_names_the_ranks_of_that_host(monkeypatch):
    """describe_failure reads where every rank runs (recorded by Heartbeat) and names the dead peer's ranks."""
    import datetime

    import torch.distributed as dist

    from loom.distributed import health
    from loom.env import free_port

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    hb = health.Heartbeat(0, 4, timeout_s=1)
    for rank, where in ((1, "node1 10.77.0.1"), (2, "node2 10.77.0.2"), (3, "node2 10.77.0.2")):
        hb.store.set(f"where/{rank}", where)
        hb.store.set(str(rank), "7")
    hb.beat(7)
    gloo = RuntimeError("[pair.cc:537] Read error [10.77.0.2]:20697: Connection reset by peer.")
    err = health.describe_failure(gloo, 0, "the gradient all-reduce", 7, 5.0, hb)
    assert "the connection to node2 (10.77.0.2) broke: rank(s) 2, 3 run there" in err.message
    loopback = RuntimeError("Read error [127.0.0.1]:20697: Connection reset by peer.")
    on_one_machine = health.describe_failure(loopback, 0, "x", 7, 5.0, hb)
    assert "broke" not in on_one_machine.message  # every rank is at 127.0.0.1: no host to name
    hb.here = ["node2", "10.77.0.2"]  # seen from rank 2: a sibling on its own host closed, not the cause
    assert "broke" not in health.describe_failure(gloo, 2, "x", 7, 5.0, hb).message
    del master  # the head's host is gone, with the store: the address in gloo's error is all there is
    gloo = RuntimeError("Read error [10.77.0.1]:20697: Connection reset by peer.")
    err = health.describe_failure(gloo, 2, "the gradient all-reduce", 7, 5.0, hb)
    assert "the connection to 10.77.0.1 broke: rank 0's host is down or unreachable" in err.message


def test_max_restarts_goes_to_torchrun_and_is_refused_elsewhere(slurm_env):
    cmd = plan_command(["--max-restarts", "3", "--", *TRAIN], {"CUDA_VISIBLE_DEVICES": "0"})
    assert cmd[:2] == ["torchrun", "--standalone"] and cmd[cmd.index("--max-restarts") + 1] == "3"
    with pytest.raises(LoomError, match="--max-restarts needs torchrun's elastic agent, not srun") as info:
        plan_command(["--max-restarts", "1", "--", *TRAIN], slurm_env)
    assert "srun --ntasks-per-node=1 loom launch" in info.value.hint
    with pytest.raises(LoomError, match="--rdzv-timeout must be > 0"):
        plan_command(["--rdzv-timeout", "0", "--", *TRAIN], slurm_env)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_garbage_node_count_is_refused(slurm_env, value):
    """Issue 42 item 9: SLURM_NNODES "abc" or "0" was taken as unset (the node list's count used instead), in
    the batch script and in a step on every node alike. Refused, naming the variable and its value."""
    from loom.launch.detect import node_task

    bad = {**slurm_env, "SLURM_NNODES": value}
    with pytest.raises(LoomError, match=f"SLURM_NNODES='{value}' is not a node count") as info:
        plan_command(["--", *TRAIN], bad)
    assert "unset SLURM_NNODES" in info.value.hint
    step = {**slurm_env, "SLURM_STEP_ID": "3", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": value}
    with pytest.raises(LoomError, match=f"SLURM_STEP_NUM_NODES='{value}' is not a node count"):
        node_task(step)
