"""`loom launch` for torchft jobs (`loom train ... --ft.enabled=true`; layer 1, never imports torch).

A replica group is one node: its own torchrun (`--standalone`, its own store), its number in
`LOOM_FT_REPLICA`, the job's lighthouse in `TORCHFT_LIGHTHOUSE`, its own run folder (`<run.name>-g<k>`, group 0
the run's own, as `loom train --nproc` names them) and `--parallel.dp_replicate=1` (HSDP's or DiLoCo's replicate
dimension is the replica groups: FSDP shards within the node). The groups meet only through the lighthouse, which
node 0's `loom launch` serves on the rendezvous port + 1 (LIGHTHOUSE_OFFSET), bound to 127.0.0.1 on one node and
to the head node's address on several, never to every interface; `--ft.lighthouse=URL` in the command uses one
the cluster runs instead. On one node without a scheduler the command becomes `loom train --nproc G`, loom's own
ft launcher (groups restarted and healed, the lighthouse on 127.0.0.1). A single `loom launch` under Slurm or PBS
starts itself once per node (`srun --ntasks-per-node 1` / `pbsdsh -u`), each node then running its group.
"""

from __future__ import annotations

import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from loom.errors import LoomError

LIGHTHOUSE_OFFSET = 1  # the lighthouse's port: the rendezvous port + this, on the head node
REPLICA_ENV = "LOOM_FT_REPLICA"  # loom.distributed.ft's: the replica group of the processes started


# loom train's own options that take a value (loom.cli.train's parser): the word after one is its value, not
# the config file; --resume's is optional (argparse takes a following word for its PATH)
_TRAIN_VALUE_OPTIONS = ("--nproc", "--max-restarts", "--world", "--resume")


def config_file(command: Sequence[str]) -> str | None:
    """The TOML config file of `loom train [FILE] ...` (its positional, as loom.cli.train reads it), or None: for
    another command, or a file that is not there (loom train itself names it, on every node)."""
    try:
        i = _train_at(command)
    except LoomError:
        return None
    args, j = command[i + 1 :], 0
    while j < len(args):
        arg = args[j]
        if not arg.startswith("-"):
            return arg if Path(arg).is_file() else None
        takes = arg in _TRAIN_VALUE_OPTIONS or (arg.startswith("--") and "." in arg and "=" not in arg)
        j += 2 if takes and j + 1 < len(args) and not args[j + 1].startswith("-") else 1
    return None


def _file_value(command: Sequence[str], key: str) -> str | None:
    """`section.key` of the command's config file as its text on a command line (a TOML true is "true")."""
    path = config_file(command)
    if path is None:
        return None
    from loom.config import load_toml

    section, _, name = key.partition(".")
    table = load_toml(path).get(section)
    value = table.get(name) if isinstance(table, dict) else None
    if value is None:
        return None
    return str(value).lower() if isinstance(value, bool) else str(value)


def option(command: Sequence[str], key: str) -> str | None:
    """The value of `--key=VALUE` or `--key VALUE` in `command` (the last one wins, as loom reads them), else
    the key in the `loom train` command's config file: the command line wins over the file, as in load_config."""
    found = None
    for i, arg in enumerate(command):
        if arg.startswith(f"--{key}="):
            found = arg.split("=", 1)[1]
        elif arg == f"--{key}" and i + 1 < len(command):
            found = command[i + 1]
    return found if found is not None else _file_value(command, key)


def is_ft(command: Sequence[str]) -> bool:
    """Whether the command trains with torchft replica groups: --ft.enabled=true on its command line, or
    `[ft] enabled = true` in the config file of its `loom train` (the flag wins)."""
    return (option(command, "ft.enabled") or "").lower() in ("true", "1", "yes")


def run_name(command: Sequence[str]) -> str:
    name = option(command, "run.name")
    if not name:
        raise LoomError(
            "loom launch of an ft job needs --run.name: each replica group (node) writes its own folder "
            "<run.name>-g<k> beside the run's",
            hint="add --run.name=NAME to the loom train command (or `name` under [run] in its config file)",
        )
    return name


def _train_at(command: Sequence[str]) -> int:
    """Where `train` is in `loom train ...` / `python -m loom train ...`; refused for anything else."""
    for i, arg in enumerate(command[:-1] if len(command) > 1 else command):
        if arg == "train" and i > 0 and Path(command[i - 1]).name == "loom":
            return i
    raise LoomError(
        "loom launch of an ft job runs `loom train ...` (its replica groups are loom's)",
        hint="loom launch --nproc-per-node G -- loom train --ft.enabled=true ...",
    )


def lighthouse_bind(head_addr: str | None, nnodes: int, port: int) -> str:
    """HOST:PORT the job's lighthouse listens on: 127.0.0.1 on one node, else the head node's address (an IP:
    torchft binds a socket address; a name that does not resolve here is kept, and the bind names it)."""
    lh_port = port + LIGHTHOUSE_OFFSET
    if nnodes == 1 or not head_addr:
        return f"127.0.0.1:{lh_port}"
    try:
        ip = socket.gethostbyname(head_addr)
    except OSError:
        ip = head_addr
    if ip in ("0.0.0.0", "::", ""):
        raise LoomError(
            f"the head address {head_addr!r} is every interface: the lighthouse binds one address",
            hint="pass --master-addr with the head node's own address",
        )
    return f"{ip}:{lh_port}"


def lighthouse_command(bind: str, command: Sequence[str]) -> list[str]:
    """torchft's lighthouse binary on `bind`, with the job's ft.min_replicas, ft.heartbeat_s and
    ft.join_timeout_s from its command line (their defaults otherwise: loom.distributed.ft.lighthouse's)."""
    from loom.config.schema import FtConfig

    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    default = FtConfig()

    def ms(key: str) -> str:
        value = option(command, f"ft.{key}")
        try:
            return str(round(1000 * float(value if value is not None else getattr(default, key))))
        except ValueError:
            raise LoomError(f"--ft.{key}={value} is not a number of seconds", hint=f"--ft.{key}=2") from None

    return [
        binary,
        "--bind",
        bind,
        "--min_replicas",
        option(command, "ft.min_replicas") or str(default.min_replicas),
        "--join_timeout_ms",
        ms("join_timeout_s"),
        "--heartbeat_timeout_ms",
        ms("heartbeat_s"),
    ]


def group_env(k: int, url: str) -> list[str]:
    """`env TORCHFT_LIGHTHOUSE=URL LOOM_FT_REPLICA=k`, in front of replica group k's torchrun."""
    return ["env", f"TORCHFT_LIGHTHOUSE={url}", f"{REPLICA_ENV}={k}"]


def group_command(command: Sequence[str], k: int, n: int) -> list[str]:
    """Replica group k of n's `loom train`: its folder, the number of groups, the job's name, a group's layout."""
    name = run_name(command)
    return [
        *command,
        f"--run.name={name if k == 0 else f'{name}-g{k}'}",
        f"--ft.replica_groups={n}",
        f"--ft.job_name={option(command, 'ft.job_name') or name}",
        "--parallel.dp_replicate=1",
    ]


def local_command(command: Sequence[str], nproc: int) -> list[str]:
    """One node, no scheduler: `loom train --nproc G ...`, loom's own ft launcher."""
    i = _train_at(command)
    return [*command[: i + 1], "--nproc", str(nproc), *command[i + 1 :]]


def per_node_launch(
    scheduler: str, nnodes: int, nproc: int, port: int, head_addr: str | None, command: Sequence[str]
) -> list[str]:
    """A single `loom launch` under a scheduler: itself once per node (each node then one replica group)."""
    again = [
        sys.executable,
        "-m",
        "loom",
        "launch",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--port",
        str(port),
        *(["--master-addr", head_addr] if head_addr else []),
        "--",
        *command,
    ]
    if scheduler == "slurm":
        return ["srun", "--nodes", str(nnodes), "--ntasks", str(nnodes), "--ntasks-per-node", "1", *again]
    if scheduler == "pbs":
        return ["pbsdsh", "-u", *again]
    raise LoomError(
        f"an ft job on {nnodes} nodes without Slurm or PBS: loom launch runs once per node",
        hint="run `loom launch --nnodes N --node-rank I --master-addr HEAD -- loom train ...` on node I "
        "(node 0 serves the lighthouse)",
    )
