"""When a collective fails or times out: which operation, and which ranks never arrived.

Each rank writes "I began step s" into the job's key-value store (the TCPStore the process group was
built on, reached through MASTER_ADDR/MASTER_PORT) before the collectives of each step: one small `set`
per step. When a collective fails, the rank that noticed reads everyone's last step; the ranks behind are
the ones that did not arrive (dead, or stuck before their collectives).

On CUDA, NCCL's own watchdog turns a stuck collective into an error after the process-group timeout;
`nccl_env()` switches on its asynchronous error handling and the flight recorder, whose dump names the
collective and the ranks that had not joined it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket

import torch.distributed as dist

from loom.env import restart_count
from loom.errors import LoomError


def nccl_env(dump_prefix: str | None = None) -> dict[str, str]:
    """Environment for NCCL jobs, set before the process group exists (values already set win).

    TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a timed-out or failed collective aborts the communicator and ends
    the process (instead of hanging on); TORCH_NCCL_TRACE_BUFFER_SIZE: the flight recorder keeps the last
    collectives; TORCH_NCCL_DUMP_ON_TIMEOUT: it writes them out when the watchdog fires.
    """
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if dump_prefix:
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = dump_prefix
    return env


COMM_WORDS = (
    "gloo",
    "nccl",
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "peer",
    "socket",
    "watchdog",
)


def is_comm_error(e: BaseException) -> bool:
    """Whether an exception came from a collective (torch's DistError, or a backend's RuntimeError)."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and any(w in str(e).lower() for w in COMM_WORDS)


class Heartbeat:
    """This rank's last begun step, kept in the job's store; `laggards(step)` after a failure."""

    def __init__(self, rank: int, world_size: int, timeout_s: float = 10.0):
        self.rank, self.world_size = rank, world_size
        attempt = restart_count()
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self.store = dist.PrefixStore(f"loom/heartbeat/{attempt}", store)
        self.here = local_addresses(os.environ["MASTER_ADDR"])
        self.store.set(f"where/{rank}", " ".join(self.here))

    def beat(self, step: int) -> None:
        self.store.set(str(self.rank), str(step))

    def laggards(self, step: int) -> list[tuple[int, int | None]]:
        """(rank, last step it began or None) for every rank that has not begun `step`."""
        out = []
        for r in range(self.world_size):
            key = str(r)
            last = int(self.store.get(key)) if self.store.check([key]) else None
            if last is None or last < step:
                out.append((r, last))
        return out

    def ranks_at(self, addresses: set[str]) -> dict[str, list[int]]:
        """Which ranks run at each of these addresses (host name or IP), from what every rank recorded."""
        out: dict[str, list[int]] = {}
        for r in range(self.world_size):
            key = f"where/{r}"
            if self.store.check([key]):
                names = self.store.get(key).decode().split()
                for a in addresses & set(names):
                    out.setdefault(f"{names[0]} ({a})" if a != names[0] else a, []).append(r)
        return out


def local_addresses(master_addr: str) -> list[str]:
    """This host's name, then the addresses peers see it at: its hostname's and the one routed to the master."""
    host = socket.gethostname()
    found = [host]
    try:
        found.append(socket.gethostbyname(host))
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))  # UDP: chooses the route and source address, sends nothing
            found.append(s.getsockname()[0])
    except OSError:
        pass
    return list(dict.fromkeys(found))


# gloo names the peer whose connection broke: "Read error [10.77.0.2]:20697: Connection reset by peer"
_PEER = re.compile(r"\[([0-9A-Za-z.:-]+)\]:\d+")


def _loopback(addr: str) -> bool:
    """On one machine every rank is at 127.0.0.1: such a peer names no host."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def describe_failure(
    e: BaseException, rank: int, op: str, step: int, timeout_s: float, heartbeat: Heartbeat | None
) -> LoomError:
    """A LoomError that names the operation, the timeout, and the ranks that did not arrive."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    what = f"did not complete within parallel.timeout_s={timeout_s:g}s" if timed_out else "failed"
    msg = f"rank {rank}: {op} {what} ({text[:300]})"
    if heartbeat is not None:
        # A peer on this rank's own host is a sibling that stopped because of the failure, not its cause.
        addresses = {a for a in _PEER.findall(text) if not _loopback(a)} - set(heartbeat.here)
        try:
            peers = heartbeat.ranks_at(addresses)
            late = heartbeat.laggards(step)
        except Exception:  # the store is gone with its host (rank 0 or the launcher)
            msg += "; the job's store is unreachable, so rank 0 or the launcher is gone"
            if addresses:
                msg += f" (the connection to {', '.join(sorted(addresses))} broke: rank 0's host is down or unreachable)"
        else:
            for where, ranks in peers.items():
                msg += f"; the connection to {where} broke: rank(s) {', '.join(map(str, ranks))} run there"
            if late:
                names = ", ".join(
                    f"rank {r} (last began step {last})" if last else f"rank {r} (never began a step)"
                    for r, last in late
                )
                msg += f"; did not arrive at step {step}: {names}"
            elif step and not peers:
                msg += f"; every rank began step {step}, so one is stuck or died inside it"
    return LoomError(
        msg,
        hint="a rank died or hangs: its own log says why (run.rank_logs=true writes <run>/logs/rank<N>.log); "
        "if steps are legitimately slower, raise parallel.timeout_s; continue with --resume",
    )
