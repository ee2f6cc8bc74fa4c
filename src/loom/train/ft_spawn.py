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
    lighthouse,
    lighthouse_url,
    refuse_live,
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
    job = cfg.ft.job_name or run_dir.name
    if cfg.ft.lighthouse:
        refuse_live(lighthouse_url(cfg.ft.lighthouse), job)
    for k in range(1, n):  # the other groups' folders, checked (and claimed) as the parent checked the run's
        resolve_run_dir(as_ddp(cfg, group_name(run_dir.name, k), str(run_dir.parent)), None, force)
    threads = str(max(1, (os.cpu_count() or 1) // n))
    with lighthouse(cfg, n) as url, _Signals() as signals, contextlib.ExitStack() as stack:
        ports = [stack.enter_context(loopback.listen(cfg.ft.timeout_s)) for _ in range(n + 1)]

        def start(k: int, attempt: int):
            env = group_env(k, url, ports[k], "" if attempt else f"{loopback.HOST}:{ports[n]}", threads)
            argv = [
                "train",
                *args,
                f"--run.name={group_name(run_dir.name, k)}",
                f"--ft.replica_groups={n}",
                f"--ft.job_name={job}",
                f"--run.dir={run_dir.parent}",
            ]
            if attempt:  # a folder with no checkpoint is started over: its records so far are kept aside
                kept.setdefault(k, []).extend(
                    set_aside(run_dir.parent / group_name(run_dir.name, k), attempt)
                )
            proc = start_loom(argv + (["--train.resume=auto"] if attempt else []), env, name=f"loom ft g{k}")
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


def group_env(k: int, url: str, port: int, barrier: str, threads: str) -> dict:
    """Group k's environment: its own 1-process world on its own store, the lighthouse, its number, and
    the start barrier (only the job's first start waits for every group)."""
    from loom.distributed import loopback

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", threads)
    env.update(MASTER_ADDR=loopback.HOST, MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    env.update(LOCAL_WORLD_SIZE="1", TORCHFT_LIGHTHOUSE=url, **{REPLICA_ENV: str(k), BARRIER_ENV: barrier})
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
            # a user error (EXIT_ERROR) would come back: only a crash or a kill is started again
            if code not in (0, EXIT_ERROR) and not signals.received and restarts[k] < max_restarts:
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
    """`loom train --nproc` with ft.enabled: the rules, before the run folder or any process."""
    if req.resume:
        raise LoomError(
            "--resume with ft.enabled: each replica group continues its own folder",
            hint="run the same command with --train.resume=auto (and the same --run.name)",
        )
    check(req.cfg, nproc)
    if req.cfg.ft.lighthouse:
        lighthouse_url(req.cfg.ft.lighthouse)
