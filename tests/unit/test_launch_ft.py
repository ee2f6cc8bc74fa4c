"""`loom launch` of torchft jobs (loom.launch.ft): the commands built for each kind of machine, compared against
the ones one would type by hand (torchft's own pattern: one torchrun per replica group, the group's number and
the lighthouse in its environment), and the lighthouse's address (127.0.0.1 on one node, the head node's on
several, never every interface). Nothing is launched here: tests/faults/test_ft_launch.py runs them."""

from __future__ import annotations

import sys

import pytest
from test_launch import clean_os_environ, pbs_env, slurm_env  # noqa: F401  (the fixtures)

from loom.env import port_from_job_id
from loom.errors import LoomError
from loom.launch import launch_main, plan_command
from loom.launch.ft import LIGHTHOUSE_OFFSET

FT = ["loom", "train", "configs/tiny.toml", "--ft.enabled=true", "--run.name=job"]
GROUP = ["--ft.replica_groups=2", "--ft.job_name=job", "--parallel.dp_replicate=1"]


def test_one_node_is_loom_train_nproc():
    """No scheduler, one node: loom's own ft launcher (it serves the lighthouse on 127.0.0.1)."""
    cmd = plan_command(["--nproc-per-node", "2", "--", *FT], {})
    assert cmd == ["loom", "train", "--nproc", "2", *FT[2:]]


def test_each_slurm_node_runs_its_group_with_its_number_and_the_lighthouse(slurm_env):  # noqa: F811
    """Inside an srun step (once per node): node k's own standalone torchrun is replica group k, its folder
    job-g<k>; every node is told the head node's lighthouse (the rendezvous port + 1)."""
    url = f"http://nid001:{port_from_job_id('123456') + LIGHTHOUSE_OFFSET}"
    for node in (0, 1):
        step = {**slurm_env, "SLURM_STEP_ID": "0", "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"}
        cmd = plan_command(["--", *FT], step)
        name = "job" if node == 0 else "job-g1"
        assert cmd == [
            "env",
            f"TORCHFT_LIGHTHOUSE={url}",
            f"LOOM_FT_REPLICA={node}",
            "torchrun",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "4",
            "--no-python",
            *FT,
            f"--run.name={name}",
            *GROUP,
        ]


def test_a_single_launch_under_slurm_or_pbs_starts_itself_on_every_node(slurm_env, pbs_env):  # noqa: F811
    port = port_from_job_id("123456")
    cmd = plan_command(["--", *FT], slurm_env)
    again = [sys.executable, "-m", "loom", "launch", "--nnodes", "2", "--nproc-per-node", "4", "--port"]
    assert cmd == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "2",
        "--ntasks-per-node",
        "1",
        *again,
        str(port),
        "--master-addr",
        "nid001",
        "--",
        *FT,
    ]
    cmd = plan_command(["--nproc-per-node", "4", "--", *FT], pbs_env)
    assert cmd[:6] == ["pbsdsh", "-u", sys.executable, "-m", "loom", "launch"]
    assert cmd[cmd.index("--master-addr") + 1] == "x3005c0s7b0n0"


def _dry_run(capsys, argv: list[str]) -> list[str]:
    assert launch_main(["--dry-run", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_node_0_serves_the_lighthouse_on_the_head_address_never_everywhere(clean_os_environ, capsys):  # noqa: F811
    """Two nodes by hand: node 0's launch serves the lighthouse bound to the head's address (an IP), node 1's
    serves none; on one node it is 127.0.0.1."""
    both = ["--nnodes", "2", "--master-addr", "127.0.0.2", "--port", "29600", "--nproc-per-node", "1"]
    lines = _dry_run(capsys, [*both, "--node-rank", "0", "--", *FT])
    assert lines[0].startswith("# torchft lighthouse") and "--bind 127.0.0.2:29601" in lines[0]
    assert "0.0.0.0" not in lines[0] and "[::]" not in lines[0]
    assert lines[1].startswith("env TORCHFT_LIGHTHOUSE=http://127.0.0.2:29601 LOOM_FT_REPLICA=0 torchrun")
    lines = _dry_run(capsys, [*both, "--node-rank", "1", "--", *FT])
    assert len(lines) == 1 and "LOOM_FT_REPLICA=1" in lines[0] and "--run.name=job-g1" in lines[0]
    with pytest.raises(LoomError, match="every interface"):
        plan_command(["--nnodes", "2", "--master-addr", "0.0.0.0", "--node-rank", "0", "--", *FT], {})


def test_the_served_lighthouse_takes_the_jobs_timeouts_and_minimum(clean_os_environ, capsys):  # noqa: F811
    """The lighthouse node 0 serves detects a dead group after the job's ft.heartbeat_s and holds a new quorum
    for a silent live group up to its ft.join_timeout_s, as the one `loom train --nproc` serves does."""
    both = ["--nnodes", "2", "--master-addr", "127.0.0.2", "--node-rank", "0", "--"]
    lines = _dry_run(capsys, [*both, *FT])
    assert "--min_replicas 1 --join_timeout_ms 10000 --heartbeat_timeout_ms 2000" in lines[0]
    job = [*FT, "--ft.heartbeat_s=0.5", "--ft.join_timeout_s", "3", "--ft.min_replicas=2"]
    lines = _dry_run(capsys, [*both, *job])
    assert "--min_replicas 2 --join_timeout_ms 3000 --heartbeat_timeout_ms 500" in lines[0]
    with pytest.raises(LoomError, match="ft.heartbeat_s=soon is not a number"):
        plan_command([*both, *FT, "--ft.heartbeat_s=soon"], {})


def test_a_cluster_lighthouse_is_used_not_served(clean_os_environ, capsys):  # noqa: F811
    url = "http://lh.cluster:29510"
    argv = [
        "--nnodes",
        "2",
        "--master-addr",
        "10.0.0.1",
        "--node-rank",
        "0",
        "--",
        *FT,
        f"--ft.lighthouse={url}",
    ]
    (line,) = _dry_run(capsys, argv)
    assert line.startswith(f"env TORCHFT_LIGHTHOUSE={url} LOOM_FT_REPLICA=0 torchrun")


@pytest.mark.parametrize(
    "argv, env, fragment",
    [
        (["--", "loom", "train", "--ft.enabled=true"], {}, "needs --run.name"),
        (["--", "python", "train.py", "--ft.enabled=true", "--run.name=x"], {}, "runs `loom train"),
        (["--nnodes", "2", "--master-addr", "h", "--", *FT], {}, "without Slurm or PBS"),
        (["--nnodes", "2", "--master-addr", "h", "--node-rank", "2", "--", *FT], {}, "outside the 2 node"),
    ],
)
def test_ft_bad_input_is_one_error(argv, env, fragment):
    with pytest.raises(LoomError, match=fragment):
        plan_command(argv, env)


# --- an ft job set in its config file (`loom train job.toml`, [ft] enabled = true) ---------------------------

FT_TOML = """
[run]
name = "job"

[ft]
enabled = true
min_replicas = 2
heartbeat_s = 0.5
join_timeout_s = 3
"""


def test_a_config_file_that_enables_ft_is_an_ft_job(tmp_path, clean_os_environ, capsys):  # noqa: F811
    """`[ft] enabled = true` in the file `loom train` reads is an ft job as --ft.enabled=true is: one node is
    loom's own ft launcher; on two, node 0 serves the lighthouse with the file's minimum and timeouts and each
    group gets its folder from the file's run.name (`python -m loom train FILE` too)."""
    job = tmp_path / "job.toml"
    job.write_text(FT_TOML, encoding="utf-8")
    train = ["loom", "train", str(job), "--model.n_layer=2"]
    assert plan_command(["--nproc-per-node", "2", "--", *train], {}) == [
        "loom",
        "train",
        "--nproc",
        "2",
        str(job),
        "--model.n_layer=2",
    ]
    both = ["--nnodes", "2", "--master-addr", "127.0.0.2", "--port", "29600", "--nproc-per-node", "1"]
    for cmd in (train, [sys.executable, "-m", "loom", "train", "--nproc", "1", str(job)]):
        lines = _dry_run(capsys, [*both, "--node-rank", "0", "--", *cmd])
        assert "--min_replicas 2 --join_timeout_ms 3000 --heartbeat_timeout_ms 500" in lines[0], lines
        assert "LOOM_FT_REPLICA=0" in lines[1] and "--ft.job_name=job" in lines[1], lines
        (line,) = _dry_run(capsys, [*both, "--node-rank", "1", "--", *cmd])
        assert "LOOM_FT_REPLICA=1" in line and "--run.name=job-g1" in line, line


def test_the_command_line_wins_over_the_config_file(tmp_path, clean_os_environ, capsys):  # noqa: F811
    """As loom's config loading: a flag overrides the file's key (--ft.heartbeat_s, and --ft.enabled=false
    makes it a plain job again); a file that does not enable ft stays a plain job unless the flag does."""
    job = tmp_path / "job.toml"
    job.write_text(FT_TOML, encoding="utf-8")
    both = ["--nnodes", "2", "--master-addr", "127.0.0.2", "--port", "29600", "--nproc-per-node", "1"]
    head = [*both, "--node-rank", "0", "--", "loom", "train", str(job)]
    lines = _dry_run(capsys, [*head, "--ft.heartbeat_s=1", "--ft.min_replicas", "1"])
    assert "--min_replicas 1 --join_timeout_ms 3000 --heartbeat_timeout_ms 1000" in lines[0], lines
    (line,) = _dry_run(capsys, [*head, "--ft.enabled=false"])
    assert "torchft" not in line and "LOOM_FT_REPLICA" not in line, line
    plain = tmp_path / "plain.toml"
    plain.write_text('[run]\nname = "job"\n\n[ft]\nmin_replicas = 2\n', encoding="utf-8")
    (line,) = _dry_run(capsys, [*both, "--node-rank", "0", "--", "loom", "train", str(plain)])
    assert "LOOM_FT_REPLICA" not in line, line
    lines = _dry_run(
        capsys, [*both, "--node-rank", "0", "--", "loom", "train", str(plain), "--ft.enabled=true"]
    )
    assert "--min_replicas 2 " in lines[0] and "LOOM_FT_REPLICA=0" in lines[1], lines
