"""`loom train --nproc N --ft.enabled=true`: the job's torchft lighthouse and its N replica groups, one process
each (loom.distributed.ft is what each group runs). Unlike `loom train --nproc` without ft (loom.train.spawn),
a group that fails does not stop the others: it is started again, joins the quorum and heals from a live peer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from loom import log
from loom.config import Config
from loom.distributed.ft import (
    BARRIER_ENV,
    REPLICA_ENV,
    as_ddp,
    check,
    in_group,
    lighthouse,
    lighthouse_url,
    on_replicate,
    refuse_live,
    replica_id,
    sharded,
)
from loom.errors import LoomError


def group_name(name: str, k: int) -> str:
    """Replica group k's run folder name: group 0 writes the run's own, group k > 0 `<run>-g<k>` beside it
    (each group is a 1-process training with its own metrics.jsonl and checkpoints)."""
    return name if k == 0 else f"{name}-g{k}"


def launch(nproc: int, cfg: Config, args: list[str], run_dir, force: bool, spawn) -> int:
    """`loom train --nproc N --ft.enabled=true`: the lighthouse (or ft.lighthouse), then N replica groups of
    one process each, each on a store of its own. A group that fails is started again (ft.max_restarts times)
    while the others go on; it joins with train.resume=auto and heals from a live peer. 0 when every group
    finished. `spawn`: loom.train.spawn, which calls this (its start_loom, _Signals and _send)."""
    from multiprocessing import connection

    from loom.distributed import loopback
    from loom.train.setup import resolve_run_dir

    _send, _Signals, start_loom = spawn._send, spawn._Signals, spawn.start_loom

    n = check(cfg, nproc)
    size = nproc // n  # processes in a group: 1 (DDP replicas), or an FSDP shard group's
    job = cfg.ft.job_name or run_dir.name
    if cfg.ft.lighthouse:
        refuse_live(lighthouse_url(cfg.ft.lighthouse), job)
    for k in range(1, n):  # the other groups' folders, checked (and claimed) as the parent checked the run's
        resolve_run_dir(as_ddp(cfg, group_name(run_dir.name, k), str(run_dir.parent)), None, force)
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    with lighthouse(cfg, n) as url, _Signals() as signals, contextlib.ExitStack() as stack:
        ports = [stack.enter_context(loopback.listen(cfg.ft.timeout_s)) for _ in range(n + 1)]

        def start(k: int, attempt: int):
            env = group_env(k, url, ports[k], "" if attempt else f"{loopback.HOST}:{ports[n]}", threads, size)
            argv = [
                "train",
                *(["--nproc", str(size)] if size > 1 else []),  # the group's own launcher: its S ranks
                *args,
                f"--run.name={group_name(run_dir.name, k)}",
                f"--ft.replica_groups={n}",
                f"--ft.job_name={job}",
                f"--run.dir={run_dir.parent}",
                *(["--parallel.dp_replicate=1"] if on_replicate(cfg) else []),  # a group: one replica
            ]
            if attempt:  # a folder with no checkpoint is started over: its records so far are kept aside
                kept.setdefault(k, []).extend(
                    set_aside(run_dir.parent / group_name(run_dir.name, k), attempt)
                )
            argv += ["--train.resume=auto"] if attempt else []
            proc = start_loom(argv, env, name=f"loom ft g{k}", server=size > 1)
            log.info(
                f"torchft: replica group {k} started (pid {proc.pid}"
                + (f", restart {attempt})" if attempt else ")")
            )
            return proc

        kept: dict[int, list[Path]] = {}
        procs = {k: start(k, 0) for k in range(n)}
        try:
            return _watch_groups(procs, start, cfg.ft.max_restarts, signals, connection, _send)
        finally:
            for k, parts in kept.items():
                merge_back(run_dir.parent / group_name(run_dir.name, k), parts)


def group_env(k: int, url: str, port: int, barrier: str, threads: str, size: int = 1) -> dict:
    """Group k's environment: the lighthouse, its number, and the start barrier (only the job's first start
    waits for every group); a 1-process group its own world on its own store, a group of `size` processes
    its own launcher (`loom train --nproc size`: its ranks, their store; a rank that fails ends the group)."""
    from loom.distributed import loopback

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", threads)
    env.update(TORCHFT_LIGHTHOUSE=url, **{REPLICA_ENV: str(k), BARRIER_ENV: barrier})
    if size == 1:
        env.update(MASTER_ADDR=loopback.HOST, MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0")
        env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return env


def set_aside(folder: Path, attempt: int) -> list[Path]:
    """A restarted group's metrics.jsonl, moved beside its folder when the folder has no checkpoint to
    continue from (train.resume=auto then starts the folder over, which would delete it)."""
    from loom import checkpoint

    metrics = folder / "metrics.jsonl"
    if not metrics.is_file() or checkpoint.latest_valid(folder / "ckpt", share=None) is not None:
        return []
    aside = folder.parent / f".{folder.name}.metrics-{attempt}.jsonl"
    shutil.move(metrics, aside)
    return [aside]


def merge_back(folder: Path, parts: list[Path]) -> None:
    """The records set aside, put back before the group's last attempt's: one metrics.jsonl in step order."""
    metrics = folder / "metrics.jsonl"
    last = metrics.read_bytes() if metrics.is_file() else b""
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_bytes(b"".join(p.read_bytes() for p in parts) + last)
    for p in parts:
        p.unlink()


def _watch_groups(procs: dict, start, max_restarts: int, signals, connection, send) -> int:
    """Wait for every group; restart a failed one (not after a signal to this process), never the others."""
    from loom.errors import EXIT_ERROR, EXIT_PREEMPTED

    codes: dict[int, int] = {}
    restarts = dict.fromkeys(procs, 0)
    passed_on = 0
    while len(codes) < len(procs):
        running = {p.sentinel: k for k, p in procs.items() if k not in codes}
        for sentinel in connection.wait(list(running), timeout=0.2):
            k = running[sentinel]
            procs[k].join()
            code = procs[k].exitcode
            # a user error (EXIT_ERROR) would come back: only a crash or a kill is started again, and not
            # once a group has finished (the job is done: started again, the group would train alone)
            ended = 0 in codes.values()
            if (
                code not in (0, EXIT_ERROR)
                and not signals.received
                and restarts[k] < max_restarts
                and not ended
            ):
                restarts[k] += 1
                log.warn(f"torchft: replica group {k} ended ({code}); the others go on; starting it again")
                procs[k] = start(k, restarts[k])
            else:
                codes[k] = code
        for signum in signals.received[passed_on:]:
            send(procs, codes, signum)
            passed_on += 1
    if all(c == 0 for c in codes.values()):
        return 0
    if signals.received:
        return EXIT_PREEMPTED
    failed = ", ".join(f"group {k} (exit {c})" for k, c in sorted(codes.items()) if c != 0)
    log.error(f"loom: torchft replica group(s) failed and were not restarted: {failed}")
    return 1


def check_launch(req, nproc: int) -> None:
    """`loom train --nproc` with ft.enabled: the rules, before the run folder or any process. The launcher of
    one group (started by the job's, or by hand with --ft.replica_id) checks the group's rules; by hand, that
    the group's number is free on the lighthouse, then passes it on to its ranks."""
    if req.resume:
        raise LoomError(
            "--resume with ft.enabled: each replica group continues its own folder",
            hint="run the same command with --train.resume=auto (and the same --run.name)",
        )
    cfg = req.cfg
    if not group_launcher(cfg):
        check(cfg, nproc)
        if cfg.ft.lighthouse:
            lighthouse_url(cfg.ft.lighthouse)
        return
    check(cfg)
    if not sharded(cfg):
        raise LoomError(
            f"--nproc {nproc} for one replica group: a DDP replica group is one process",
            hint="groups of several processes are FSDP shard groups: --parallel.dp_impl=fsdp",
        )
    if not in_group():  # by hand: its number must be free, and its ranks are told it
        url = lighthouse_url(cfg.ft.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"])
        refuse_live(url, cfg.ft.job_name or cfg.run.name or "loom", replica_id(cfg))
        os.environ[REPLICA_ENV] = str(replica_id(cfg))


def group_launcher(cfg: Config) -> bool:
    """`loom train --nproc S` that starts one replica group's S ranks (not the whole job)."""
    return in_group() or cfg.ft.replica_id >= 0
