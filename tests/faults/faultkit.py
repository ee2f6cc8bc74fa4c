"""Helpers for the fault-injection suite: start real `loom train` processes, watch their metrics, kill
them at a step, and look at what is left (processes, sockets, checkpoints)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from proctree import alive, descendants, rank_of  # noqa: F401 (re-exported for the fault tests)
from tiny import tiny_args

from loom.cli import main
from loom.metrics import read_jsonl

# The configuration the kill/stop/resume tests share (a module, not conftest: a bare `conftest` import
# resolves to whichever folder's conftest.py pytest imported first)
STEPS = 40
CKPT = ["--train.ckpt_every=6", "--train.keep_last=10"]

LOOM = [sys.executable, "-m", "loom"]
# Tiny and CPU-only; dropout on, so the RNG state must come back exactly on resume.
TINY = tiny_args(
    {"model.block_size": 16, "model.dropout": 0.1, "train.eval_batches": 1, "optim.warmup_steps": 2}
)
ENV = {"OMP_NUM_THREADS": "1"}  # the same matmul blocking in every process: bit-exact comparisons


def train_args(data: Path, runs: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [
        "train",
        f"--data.path={data}",
        f"--run.dir={runs}",
        f"--run.name={name}",
        f"--train.steps={steps}",
        *TINY,
        *extra,
    ]


def run_inprocess(args: list[str]) -> int:
    """`loom <args>` in this process, with one thread like the subprocesses (same floating-point order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(args)
    finally:
        torch.set_num_threads(threads)


# The fork server's loop (runs in its own interpreter): one JSON request a line, answered with the exit code.
_FORK_SERVER = r"""
import json, os, signal, sys, time, traceback
import torch  # noqa: F401  (what every row would import again: most of a row's time)
import loom.cli
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY), (2, req["err"], os.O_WRONLY)):
            os.dup2(os.open(path, mode | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o600), fd)
        sys.argv = ["loom", *req["argv"]]
        try:
            code = loom.cli.main(req["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    deadline = time.monotonic() + req["timeout"]
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.killpg(pid, signal.SIGKILL)
        done = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(done[1])), flush=True)
"""


class ForkServer:
    """`python -m loom ARGV` many times, each run a process of its own forked from one interpreter that
    imported torch and loom once: what a subprocess per run gives (its own process, cwd, environment, exit
    code, stdout and stderr; a traceback printed as Python prints one), without torch's import each time
    (about 1.9 s of CPU of a 2 s bad-input row). The server itself is started with OMP_NUM_THREADS=1."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FORK_SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENV},
        )

    def run(self, argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of `loom argv` run in cwd with exactly `env`; killed after timeout."""
        out, err = self.tmp / "row.out", self.tmp / "row.err"
        req = {
            "argv": argv,
            "cwd": str(cwd),
            "env": env,
            "out": str(out),
            "err": str(err),
            "timeout": timeout,
        }
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        code = json.loads(self.proc.stdout.readline())
        return code, out.read_text(), err.read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


STARTED: list[Proc] = []  # every Proc, so that conftest kills what a failed test left running


class Forked:
    """What the fault tests ask of a `subprocess.Popen` (pid, poll, wait, returncode) for a `loom` command
    started as a fork of loom's preloaded fork server (loom.train.spawn.start_loom): ~4 s of CPU fewer a start
    than a new interpreter's imports. Its parent is the fork server, which reaps it."""

    def __init__(self, args: list[str], env: dict[str, str], out: int, err: int):
        from loom.train.spawn import start_loom

        self.args = [*LOOM, *args]
        self.proc = start_loom(list(args), env, out=out, err=err, session=True, server=True)
        self.pid = self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.proc.exitcode


class Proc:
    """A `loom` command in its own session (a warm fork, Forked), output in files (a full pipe would block
    it)."""

    def __init__(self, args: list[str], out: Path, env: dict[str, str] | None = None):
        self.out = out
        self.t0 = time.monotonic()
        STARTED.append(self)
        with open(out.with_suffix(".stdout"), "w") as o, open(out.with_suffix(".stderr"), "w") as e:
            self.p = Forked(args, {**os.environ, **ENV, **(env or {})}, o.fileno(), e.fileno())

    @property
    def pid(self) -> int:
        return self.p.pid

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"loom did not end within {timeout}s:\n{self.stderr()[-3000:]}") from None

    def stdout(self) -> str:
        return self.out.with_suffix(".stdout").read_text()

    def stderr(self) -> str:
        return self.out.with_suffix(".stderr").read_text()

    def tree(self) -> list[int]:
        """This process and all its descendants (the elastic agent's workers)."""
        return [self.p.pid, *descendants(self.p.pid)]

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        tree = self.tree()
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        self.p.wait(30)
        deadline = time.monotonic() + 10  # orphaned workers are reaped by init a moment later
        while alive(tree) and time.monotonic() < deadline:
            time.sleep(0.01)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return read_jsonl(path, superseded=True) if path.exists() else []  # every line, as written


def curve(run: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (replayed after a resume) keeps its last value."""
    return {r["step"]: r["loss"] for r in records(run) if "loss" in r}


def last_step(run: Path) -> int:
    steps = [r["step"] for r in records(run) if "loss" in r]
    return max(steps) if steps else 0


def wait_for(cond, proc: Proc | None = None, timeout: float = 120, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.p.poll() is not None:
            raise AssertionError(f"loom exited ({proc.p.returncode}) before {what}:\n{proc.stderr()[-3000:]}")
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def listening_addresses(pids: list[int]) -> list[str]:
    """'ip:port' of every listening TCP socket owned by these processes (IPv4 and IPv6)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                addr, port = f[1].split(":")
                out.append(f"{_ip(addr, v6)}:{int(port, 16)}")
    return out


def _ip(hexaddr: str, v6: bool) -> str:
    raw = bytes.fromhex(hexaddr)
    if not v6:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]  # four little-endian 32-bit words
    import ipaddress

    return str(ipaddress.IPv6Address(b"".join(words)))


def fill_disk_in_save_file(monkeypatch) -> None:
    """safetensors' save_file as on a disk that fills half way: half the file written, then the error its
    Rust writer raises for ENOSPC (a SafetensorError, not an OSError), as seen on a full tmpfs."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
