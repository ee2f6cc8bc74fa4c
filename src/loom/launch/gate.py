"""Before torchrun starts on several nodes, every node checks in with the head (layer 1, stdlib only).

A torchrun rendezvous that cannot form does not say why: with a wrong `MASTER_ADDR` (`localhost`, or a
name that is not the head node) each node waits alone until the join timeout; a node that never starts
is not named; a port held by another job, two installs of loom, or a different `--nproc-per-node` on
one node show late or not at all. So `loom launch` first runs this gate on the rendezvous port:

    head (node 0)   resolves MASTER_ADDR, must own it (bind) and the port must be free; listens;
                    collects one hello per node: host, loom / torch / Python versions, nproc per node
    other nodes     connect to MASTER_ADDR:PORT (retrying until the timeout) and send their hello

The head compares the hellos and answers every node "go" or the one error they all print; then it
closes the port, and torchrun's c10d store binds it. Every failure is a `LoomError` that names the
node and says what to change; nothing waits longer than the rendezvous timeout.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import platform
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from loom import log
from loom.errors import LoomError

# For tests of the version check: the loom version this node reports instead of its own.
VERSION_OVERRIDE = "LOOM_REPORTED_VERSION"
_RETRY_S = 0.25
_BANNER = {"loom-gate": 1}
_BANNER_WAIT_S = 10.0  # the head answers nodes one by one; a running job's store never greets


@dataclass(frozen=True)
class Hello:
    """What a node tells the head: enough to refuse a job whose nodes do not match."""

    node: int
    host: str
    loom: str
    torch: str
    python: str
    nproc: int


def local_hello(node: int, nproc: int, environ: Mapping[str, str] | None = None) -> Hello:
    """This node's hello; versions read without importing torch (importlib.metadata)."""
    from importlib import metadata

    from loom import __version__

    environ = os.environ if environ is None else environ
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return Hello(
        node=node,
        host=socket.gethostname(),
        loom=environ.get(VERSION_OVERRIDE) or __version__,
        torch=torch_version,
        python=platform.python_version(),
        nproc=nproc,
    )


def mismatches(hellos: Sequence[Hello]) -> list[str]:
    """One line per field on which the nodes disagree, naming each node's value."""
    problems = []
    for field, what in (
        ("loom", "loom versions"),
        ("torch", "torch versions"),
        ("nproc", "processes per node"),
    ):
        values = {getattr(h, field) for h in hellos}
        if len(values) > 1:
            each = ", ".join(f"{h.host} {getattr(h, field)}" for h in sorted(hellos, key=lambda h: h.node))
            problems.append(f"{what} differ: {each}")
    return problems


_REMEDY = {
    "loom versions": "install the same loom on every node (one environment on a shared filesystem, or the "
    "same pip install everywhere)",
    "torch versions": "install the same torch on every node",
    "processes per node": "start every node with the same --nproc-per-node (it defaults to the node's GPUs)",
}


def _resolve(addr: str, port: int, host: str) -> str:
    try:
        return socket.getaddrinfo(addr, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise LoomError(
            f"the rendezvous address MASTER_ADDR={addr} does not resolve on {host} ({e.strerror})",
            hint="set MASTER_ADDR (or --master-addr) to the head node's name or IP address, or leave it "
            "unset inside a Slurm/PBS allocation (the first node is used)",
        ) from None


def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall((json.dumps(obj) + "\n").encode())


def _recv(conn: socket.socket, deadline: float) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed before a full message")
        buf += chunk
    return json.loads(buf)


def head_gate(
    addr: str,
    port: int,
    nnodes: int,
    hello: Hello,
    timeout: float,
    hosts: Sequence[str] = (),
    command: str = "loom launch",
) -> list[Hello]:
    """On node 0: own `addr:port`, gather the other nodes' hellos, answer them; returns every hello.
    `command` is what runs the gate on every node (loom launch, or loom doctor --nodes), named in hints."""
    ip = _resolve(addr, port, hello.host)
    if nnodes > 1 and ipaddress.ip_address(ip).is_loopback:
        raise LoomError(
            f"the rendezvous address MASTER_ADDR={addr} is a loopback address ({ip}) on {hello.host}: the "
            f"other {nnodes - 1} node(s) cannot reach it",
            hint="set MASTER_ADDR to the head node's name or address on the network the nodes share"
            + (f" (the allocation's first host is {hosts[0]})" if hosts else ""),
        )
    server = _bound(addr, ip, port, hello, hosts)
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[Hello, socket.socket]] = {}
    try:
        server.listen(max(8, nnodes))
        _gather(server, nnodes, deadline, got)
        # Stop listening before anyone is told to go: a node's torchrun that connects early must be refused
        # (it retries) rather than queued on this socket and reset when it closes.
        server.close()
        hellos = [hello, *(h for h, _ in got.values())]
        error = _verdict(hellos, nnodes, addr, port, timeout, hosts, command)
        _answer(got, error)
    finally:
        server.close()
        for _, conn in got.values():
            conn.close()
    if error:
        raise error
    return sorted(hellos, key=lambda h: h.node)


def _bound(addr: str, ip: str, port: int, hello: Hello, hosts: Sequence[str]) -> socket.socket:
    """A TCP socket bound to ip:port on the head node; a port in use or an address not this node's refused."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((ip, port))
    except OSError as e:
        server.close()
        if e.errno == errno.EADDRINUSE:
            raise LoomError(
                f"port {port} is already in use on the head node {hello.host}",
                hint="another job or a leftover process holds it (ss -ltnp shows which): pass --port P, the "
                "same on every node, or set MASTER_PORT",
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise LoomError(
                f"the rendezvous address MASTER_ADDR={addr} ({ip}) is not an address of {hello.host}, the head "
                "node (node 0, where rank 0 and the rendezvous run)",
                hint="unset MASTER_ADDR to use the allocation's first host"
                + (f" ({hosts[0]})" if hosts else "")
                + ", or set it to an address of the head node",
            ) from None
        raise
    return server


def _gather(server: socket.socket, nnodes: int, deadline: float, got: dict) -> None:
    """The other nodes' hellos into got ({node: (hello, connection)}) until all came or the deadline passed."""
    while len(got) < nnodes - 1 and time.monotonic() < deadline:
        server.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            break
        try:
            _send(conn, _BANNER)  # the head speaks first: a node can tell the gate from a running job
            other = Hello(**_recv(conn, min(deadline, time.monotonic() + 10)))
        except (OSError, ValueError, TypeError):
            conn.close()  # not a loom node (a port scan, another program): ignore it
            continue
        if other.node in got or other.node == 0 or not 0 < other.node < nnodes:
            _send(conn, {"error": f"node index {other.node} of {other.host} is taken or out of range"})
            conn.close()
            continue
        got[other.node] = (other, conn)


def _answer(got: dict, error: LoomError | None) -> None:
    """Tell every node the verdict, then wait for each to close its side first."""
    for _, conn in got.values():
        _send(conn, {"error": error.message, "hint": error.hint} if error else {"ok": True})
    for _, conn in got.values():  # let each node close first: TIME_WAIT stays on its side, not on PORT
        try:
            conn.settimeout(5)
            conn.recv(1)
        except OSError:
            pass
        conn.close()


def _verdict(
    hellos: list[Hello],
    nnodes: int,
    addr: str,
    port: int,
    timeout: float,
    hosts: Sequence[str],
    command: str = "loom launch",
):
    missing = sorted(set(range(nnodes)) - {h.node for h in hellos})
    if missing:
        names = ", ".join(f"{hosts[i]} (node {i})" if i < len(hosts) else f"node {i}" for i in missing)
        return LoomError(
            f"no word from {names} within {timeout:g}s at the rendezvous {addr}:{port}; "
            f"{len(hellos)} of {nnodes} nodes checked in",
            hint=f"start {command} on every node of the job; check that the host is up and can reach "
            f"{addr}:{port}"
            + (
                ""
                if command != "loom launch"
                else " (loom doctor --nodes HOSTFILE checks every host before a job)"
            ),
        )
    problems = mismatches(hellos)
    if problems:
        remedies = "; ".join(r for k, r in _REMEDY.items() if any(p.startswith(k) for p in problems))
        return LoomError("nodes do not match: " + "; ".join(problems), hint=remedies)
    return None


def node_gate(
    addr: str,
    port: int,
    hello: Hello,
    timeout: float,
    hosts: Sequence[str] = (),
    rejoin: bool = False,
    command: str = "loom launch",
) -> None:
    """On node k > 0: reach the head at `addr:port` (retrying until `timeout`), send the hello, obey the answer.

    With `rejoin` (torchrun --max-restarts), a port that answers but not as the gate is taken to be a job
    already running there (torchrun's store), which this node joins at its next restart.
    """
    deadline = time.monotonic() + timeout
    last = "no attempt"
    conn = None
    while time.monotonic() < deadline:
        try:
            ip = _resolve(addr, port, hello.host)
            conn = socket.create_connection(
                (ip, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))
            )
            break
        except LoomError as e:
            last = e.message
        except OSError as e:
            last = e.strerror or type(e).__name__
        time.sleep(_RETRY_S)
    if conn is None:
        head = f"; the allocation's first host is {hosts[0]}" if hosts else ""
        raise LoomError(
            f"{hello.host} (node {hello.node}) could not reach the rendezvous MASTER_ADDR={addr} port {port} "
            f"within {timeout:g}s ({last})",
            hint=f"check that MASTER_ADDR names the head node{head}, that {command} runs there, and that "
            "the port is open between the nodes",
        )
    with conn:
        try:  # the gate greets first; a running job's store (torchrun's) says nothing and is left alone
            now = time.monotonic()
            banner = _recv(conn, min(max(deadline, now + 1), now + _BANNER_WAIT_S))
        except (OSError, ValueError):
            banner = None
        if banner != _BANNER:
            if rejoin:
                log.warn(
                    f"loom launch: {addr}:{port} is not the launch gate but a running job: this node "
                    "joins it at its next restart (--max-restarts)"
                )
                return
            raise LoomError(
                f"{hello.host} (node {hello.node}): {addr}:{port} answers, but not as {command} on the head "
                "node: a job already runs there, or another program holds the port",
                hint="pass --port P (the same on every node)"
                + (
                    ", or --max-restarts N on every node so that a node that comes back rejoins a running job"
                    if command == "loom launch"
                    else ""
                ),
            )
        try:
            _send(conn, asdict(hello))
            answer = _recv(conn, deadline + 10)
        except (OSError, ValueError) as e:
            raise LoomError(
                f"{hello.host} (node {hello.node}): the head at {addr}:{port} stopped answering ({e})",
                hint=f"look at the head node's output: its {command} says why",
            ) from None
    if "error" in answer:
        raise LoomError(answer["error"], hint=answer.get("hint"))
