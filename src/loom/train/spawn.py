"""`loom train --nproc N`: N local processes, each a fork of a server that imported torch and loom once.

The parent does the cheap checks once (config, world size against the batch, run directory, data
preparation), so a mistake gives one message instead of N, and the children agree on the run name.

The workers are not new interpreters: a multiprocessing fork server, started once per parent and preloaded
with torch and loom's training modules (PRELOAD; it only imports, never runs an op, so no thread, OpenMP pool
or CUDA context is lost in a fork), forks each one. A worker starts in a fraction of a second instead of
importing torch again (~4 s of CPU each; on a node of 8 GPUs, 8 imports at once from a shared filesystem).
Each worker gets this process's environment, folder, stdout and stderr, and the variables torchrun's agent
would set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT, ...): its processes
join the store this process serves on 127.0.0.1 only (loopback.listen), as torchrun's workers join their
agent's store, so `loom train` runs the same code under both.

What torchrun's local agent does, this one does: the first worker that fails stops the others (SIGTERM,
then SIGKILL FAILED_GRACE_S later, in whatever phase they are, a checkpoint save's collectives included) and
is named; with max_restarts the whole group starts again on a fresh store (the workers resume from the newest
complete checkpoint; a half-written step_N.tmp is never read); SIGTERM, SIGINT or SIGHUP to this process
reach the workers, which finish their step, save and exit with EXIT_PREEMPTED (SIGKILL after the shutdown
timeout).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import connection, reduction

from loom import log
from loom.config import ParallelDims, validate
from loom.errors import EXIT_PREEMPTED, LoomError
from loom.train import RunRequest, layout_config, plan_run

# What every worker imports, imported once by the fork server (a module it cannot import is skipped there).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.optim",  # ZeRO-1's optimizer; with the two below, ~0.4 s of a worker's imports
    "torch.distributed.checkpoint.state_dict",
    "rich.console",
    "loom.cli.train",
    "loom.train.trainer",
    "loom.parallel",
    "loom.parallel.dcp_state",
]
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Seconds from the SIGTERM that follows a rank's failure to the SIGKILL of the ranks still running. They have
# nothing left to do: a sharded save needs every rank, and the group starts again from the newest checkpoint.
# Without it, survivors stuck in a collective with the dead rank (two ranks of a save left in different gloo
# waits when the third died inside DCP's gather: seen in benchmarks/chaos.py) held the job for
# parallel.timeout_s (600 s), until their own give-up (loom.train.guard); one whose timeout_s is shorter than
# this still gives up first, with its own message.
FAILED_GRACE_S = 10.0
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # Linux's prctl(2)


@dataclass
class Exit:
    """How a worker ended: its exit code (-N: killed by signal N), pid, and when this process saw it."""

    code: int
    pid: int
    time: float
    stopped: bool = (
        False  # this process stopped it (the group was stopping; a SIGKILL only once this one sent it)
    )

    def how(self) -> str:
        return signal.Signals(-self.code).name if self.code < 0 else f"exit code {self.code}"


def launch_local(nproc: int, req: RunRequest, child_argv: list[str], max_restarts: int = 0) -> int:
    """Check once here, then run `loom train <child_argv>` in nproc workers. Returns an exit code.

    With max_restarts > 0 all workers start again after a failure; restarted workers see
    TORCHELASTIC_RESTART_COUNT > 0 and continue from the newest valid checkpoint of the run.
    """
    from loom import checkpoint

    if req.cfg.ft.enabled:  # torchft replica groups: their checks before any other (loom.distributed.ft)
        from loom.train import ft_spawn

        ft_spawn.check_launch(req, nproc)
    plan = plan_run(req, _local_dims(req, nproc), hashes=False)  # raises before any process starts;
    # the workers hash the checkpoint's files, each its share
    args = [a for a in child_argv if a != "--force"]
    if req.cfg.ft.enabled and not ft_spawn.group_launcher(req.cfg):  # else: one group's ranks, below
        return ft_spawn.launch(nproc, req.cfg, args, plan.run_dir, req.force, sys.modules[__name__])
    if not req.resume:
        args.append(f"--run.name={plan.run_dir.name}")
    timeout_s = req.cfg.parallel.timeout_s
    # one torchft replica group's ranks: a failed rank ends the group at once (SIGKILL 1 s after SIGTERM); the
    # job's launcher starts it again and it heals from a live group, nothing of it needs saving
    failed_s = 1.0 if req.cfg.ft.enabled else FAILED_GRACE_S
    restarts = f", up to {max_restarts} restart(s)" if max_restarts else ""
    log.info(f"starting {nproc} processes (store on 127.0.0.1{restarts}) for run {plan.run_dir}")
    job = f"loom-{uuid.uuid4().hex[:8]}"
    with _Signals() as signals:
        for attempt in range(max_restarts + 1):
            exits = _run_group(
                nproc, ["train", *args], job, attempt, max_restarts, timeout_s, signals, None, failed_s
            )
            if all(e.code == 0 for e in exits.values()):
                return 0
            if signals.received:
                newest = checkpoint.latest_valid(plan.run_dir / "ckpt")
                log.error(
                    f"loom: {signals.received[0].name}: the processes were asked to save and stop; "
                    + (f"newest checkpoint {newest}" if newest else "no checkpoint was saved")
                )
                return EXIT_PREEMPTED
            if attempt < max_restarts:
                log.warn(
                    f"loom: a worker failed; starting the {nproc} processes again ({attempt + 1} of {max_restarts})"
                )
    return _report_failure(exits)


def run_local(nproc: int, argv: list[str], timeout_s: float, shutdown_s: float) -> int:
    """`loom ARGV` in nproc local workers started as `loom train --nproc` starts its ranks (`loom serve --nproc`):
    one round, no restarts; SIGTERM, SIGINT or SIGHUP to this process reach every worker, SIGKILL follows
    shutdown_s later. 0 when every worker exits 0 (a server drained by SIGTERM does), else the failure named."""
    job = f"loom-{uuid.uuid4().hex[:8]}"
    with _Signals() as signals:
        exits = _run_group(nproc, argv, job, 0, 0, timeout_s, signals, shutdown_s)
    return 0 if all(e.code == 0 for e in exits.values()) else _report_failure(exits)


def _run_group(
    nproc, argv, job, attempt, max_restarts, timeout_s, signals, shutdown_s=None, failed_s=None
) -> dict[int, Exit]:
    """One round: nproc workers running `loom ARGV` on a fresh store, watched until every one has ended."""
    from loom.distributed import loopback

    with loopback.listen(timeout_s) as port:
        common = dict(os.environ)
        common.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        common.update(
            MASTER_ADDR=loopback.HOST,
            MASTER_PORT=str(port),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            TORCHELASTIC_RUN_ID=job,
            LOOM_NPROC_JOB=job,  # the log says "loom --nproc" started them, not torchrun (loom.env)
            TORCHELASTIC_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
            TORCHELASTIC_USE_AGENT_STORE="True",  # env:// joins this store instead of rank 0 serving one
        )
        procs = {}
        for rank in range(nproc):
            env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs[rank] = start_loom(argv, env, name=f"loom rank {rank}")
        return _watch(procs, signals, shutdown_s=shutdown_s or max(10.0, timeout_s), failed_s=failed_s)


def _watch(
    procs: dict, signals: _Signals, shutdown_s: float, failed_s: float | None = None
) -> dict[int, Exit]:
    """Wait for every worker. The first failure, or a signal to this process (passed on to the workers), stops
    the group: the others get SIGTERM (or that signal), and SIGKILL after shutdown_s (`failed_s` after a
    failure, when given)."""
    exits: dict[int, Exit] = {}
    passed_on, deadline, killing, grace = 0, None, False, shutdown_s
    while len(exits) < len(procs):
        running = {p.sentinel: r for r, p in procs.items() if r not in exits}
        for sentinel in connection.wait(list(running), timeout=0.2):
            p = procs[running[sentinel]]
            p.join()
            # a SIGKILL this process did not send (the kernel's OOM killer, a user) is a cause even when its news
            # arrives after another rank's failure (the ranks that saw it die can exit first)
            ours = deadline is not None and (p.exitcode != -signal.SIGKILL or killing)
            exits[running[sentinel]] = Exit(p.exitcode, p.pid, time.monotonic(), ours)
        for signum in signals.received[passed_on:]:
            _send(procs, exits, signum)
            passed_on += 1
        if deadline is None and (passed_on or any(e.code != 0 for e in exits.values())):
            failed = not passed_on and any(e.code not in (0, EXIT_PREEMPTED) for e in exits.values())
            grace = failed_s if failed and failed_s is not None else shutdown_s
            deadline = time.monotonic() + grace
            # a rank that stopped on a signal (EXIT_PREEMPTED) agreed the stop step with the others, which are
            # saving and leaving too: a SIGTERM now would kill one in its exit; SIGKILL after shutdown_s still
            if not passed_on and any(e.code not in (0, EXIT_PREEMPTED) for e in exits.values()):
                _send(procs, exits, signal.SIGTERM)
        elif deadline is not None and time.monotonic() > deadline and not killing:
            _kill_the_rest(procs, exits, grace)
            killing = True
    return exits


def _kill_the_rest(procs: dict, exits: dict, grace: float) -> None:
    """SIGKILL to the workers still running `grace` seconds after they were told to stop, named in the log."""
    left = ", ".join(f"rank {r} (pid {p.pid})" for r, p in procs.items() if r not in exits)
    log.warn(f"loom: {left} still running {grace:g}s after the stop: SIGKILL")
    _send(procs, exits, signal.SIGKILL)


def _send(procs: dict, exits: dict, signum: int) -> None:
    for rank, p in procs.items():
        if rank not in exits:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass


class _Signals:
    """SIGTERM, SIGINT and SIGHUP to this process while the workers run: recorded here, passed on by _watch (where
    the main thread can, the only thread that receives signals)."""

    def __init__(self):
        self.received: list[signal.Signals] = []
        self._old: dict = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._on) for s in FORWARDED}
        return self

    def _on(self, signum: int, frame) -> None:
        self.received.append(signal.Signals(signum))

    def __exit__(self, *exc) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def start_loom(
    argv: list[str],
    env: dict,
    cwd: str | None = None,
    out: int = 1,
    err: int = 2,
    name: str = "loom",
    session: bool = False,
    server: bool = False,
) -> multiprocessing.process.BaseProcess:
    """`python -m loom ARGV` with environment `env`, started (not waited for) as a fork of this process's fork
    server, preloaded with torch and loom (PRELOAD): ~0.1 s of CPU to start instead of ~4 s for a new
    interpreter's imports. Its stdout and stderr are this process's file descriptors `out` and `err` (a log
    file's, for one), its stdin /dev/null, its folder `cwd` (default: this one's); `env`'s PYTHONPATH goes
    before this process's import path, as an interpreter would put it; `session`: a session of its own, so
    that `os.killpg(p.pid, ...)` ends everything it started; `server`: the workers it starts (`train --nproc`,
    verify) are forks of a fork server of its own made by forking it at its start (own_server), not of a new
    interpreter's. It is killed if the fork server ends (with this process). The ranks of `loom train --nproc`
    and the GPU kit's lines start this way."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (this process's first start)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = [*extra, *(p for p in sys.path if p not in extra)]
    proc = ctx.Process(
        target=_worker,
        args=(argv, env, cwd or os.getcwd(), path, session, server, _Stdio(out, err)),
        name=name,
    )
    proc.start()
    return proc


def start_server() -> None:
    """This process's fork server, started if it is not running, and ready: returns once it has imported
    PRELOAD (a few seconds, once), so that the first start_loom after it takes no longer than the others."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    ready = ctx.Process(target=int, name="loom server check")  # forked once the imports are done
    ready.start()
    ready.join()


class _Stdio:
    """File descriptors of this process (its stdout and stderr, or a log's) for a worker: the fork server passes
    them on as file descriptors (multiprocessing's DupFd, at the pickling of the worker's arguments);
    otherwise a worker would write to the server's, those of whichever moment started it."""

    def __init__(self, out: int = 1, err: int = 2):
        self.fds = out, err

    def __reduce__(self):
        return _attach, tuple(reduction.DupFd(fd) for fd in self.fds)


def _attach(out, err) -> None:
    for wrapped, fd in ((out, 1), (err, 2)):
        passed = wrapped.detach()
        os.dup2(passed, fd)
        os.close(passed)


def _worker(
    argv: list[str], env: dict, cwd: str, path: list[str], session: bool, server: bool, _stdio: None
) -> None:
    """A loom command, in a fork of the server (whose environment, folder and path were those of when it
    started); its process name (ps, top) is the multiprocessing one it was given."""
    if session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    _linux_prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the server ends with the launcher: so does the command
    _linux_prctl(PR_SET_NAME, multiprocessing.current_process().name.encode()[:15])
    if server:
        own_server()
    import torch

    # OpenMP read OMP_NUM_THREADS when the server imported torch: set what a new interpreter would have read
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["loom", *argv]
    try:
        runpy.run_module("loom", run_name="__main__", alter_sys=True)  # `python -m loom ARGV`, as exec'd
    finally:
        stop_server()  # its own server (server=True) ends before it does, not a moment after


def own_server() -> None:
    """Make this process's fork server by forking this process, which must still be as the fork server left it
    (PRELOAD imported, no op run, no thread: a fork of it is what a new server would be once it had imported),
    instead of the new interpreter multiprocessing starts, whose imports cost ~4 s of CPU. The child runs
    multiprocessing's server loop; this process becomes its client as if it had started it (so stop_server
    stops it, and it ends when this process and its workers have). Python's private names (its forkserver
    module's client state, as in stop_server), checked on 3.11: where they are missing (or on 3.14, where the server checks a key), nothing is done
    and multiprocessing starts its own server when needed."""
    import socket
    from multiprocessing import forkserver, util

    fs = getattr(forkserver, "_forkserver", None)
    # 3.14's server asks its clients for a key this process could not give
    if (
        not hasattr(fs, "_forkserver_pid")
        or fs._forkserver_pid is not None
        or hasattr(fs, "_forkserver_authkey")
    ):
        return
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # EOF for the server once this process and its workers have ended
    pid = os.fork()
    if pid == 0:  # the server: multiprocessing's loop, what `python -c "...forkserver import main..."` runs
        os.close(alive_w)
        _linux_prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _linux_prctl(PR_SET_NAME, b"loom server")
        try:
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    fs._forkserver_address, fs._forkserver_alive_fd, fs._forkserver_pid = address, alive_w, pid


def _linux_prctl(option: int, value) -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass


def stop_server() -> None:
    """Stop this process's fork server and the resource tracker it started, if any, and wait for them. They end
    by themselves when this process does, a moment later; waited for here, nothing of a job outlives the
    command that launched it. (Both `_stop`s are private to multiprocessing, used by Python's own tests; they
    exist from Python 3.8 on, checked on 3.11.)"""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    for module, name, pid in (
        (multiprocessing.forkserver, "_forkserver", "_forkserver_pid"),
        (multiprocessing.resource_tracker, "_resource_tracker", "_pid"),
    ):
        started = getattr(module, name, None)
        # one this process started (a fork of the server inherits the tracker's pipe, not its pid: not its to stop)
        if getattr(started, pid, None) is not None:
            started._stop()


def _local_dims(req: RunRequest, nproc: int) -> ParallelDims:
    """The layout of `nproc` local processes (rank 0's), after every rule of config.validate() on the config whose
    layout they run (the saved one when resuming), before any process starts."""
    if nproc < 1:
        raise LoomError(f"--nproc must be >= 1, got {nproc}")
    layout = layout_config(req)
    if layout.parallel.dp_impl == "mpi" and nproc > 1:  # each child would be its own 1-process MPI world
        raise LoomError(
            f"--nproc {nproc} with parallel.dp_impl=mpi would start {nproc} separate 1-process trainings "
            "into the same run: MPI processes are started by mpiexec, not by --nproc",
            hint=f"mpiexec -n {nproc} loom train ... (without --nproc), or "
            f"loom launch --launcher mpiexec --nproc-per-node {nproc} -- loom train ...",
        )
    return validate(layout, nproc)[1]


def _report_failure(exits: dict[int, Exit]) -> int:
    """The exit code of a job whose workers failed, and one line naming the rank that failed first: a rank
    killed by a signal is the cause when the others only saw it die."""
    failed = {r: e for r, e in exits.items() if e.code != 0}
    if all(e.code == EXIT_PREEMPTED for e in failed.values()):
        log.error(f"loom: stopped by a signal after saving a checkpoint (exit code {EXIT_PREEMPTED})")
        return EXIT_PREEMPTED
    # the cause is among the ranks that failed before this process stopped the others; of those, a rank killed
    # by a signal (SIGTERM last) is the cause when the others only saw it die
    causes = {r: e for r, e in failed.items() if not e.stopped} or failed
    first_rank = min(causes, key=lambda r: causes[r].time)
    killed = sorted((e.code == -signal.SIGTERM, e.time, r) for r, e in causes.items() if e.code < 0)
    if killed and (causes[first_rank].code >= 0 or causes[first_rank].code == -signal.SIGTERM):
        first_rank = killed[0][2]
    first = failed[first_rank]
    others = [f"rank {r} ({e.how()})" for r, e in sorted(failed.items()) if r != first_rank]
    log.error(
        f"loom: error: rank {first_rank} (pid {first.pid}) failed first: {first.how()}; the other ranks were "
        "stopped" + (f" ({', '.join(others)} after it)" if others else "")
    )
    return 1
