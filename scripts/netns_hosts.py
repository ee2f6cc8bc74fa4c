"""Several "hosts" on one Linux machine: network namespaces joined by a bridge, for multi-node tests.

Each host is a network namespace with its own stack: one interface `eth0` at 10.77.0.N/24, loopback,
and its own /etc/hosts (from /etc/netns/<ns>/hosts, which `ip netns exec` mounts over /etc/hosts).
Commands run "on a host" through `ip netns exec NS unshare --uts`, with the hostname set to the host's
name (node1, node2, ...), so `socket.getfqdn()` and gloo's own-address lookup see a real node, not the
machine's loopback name. The bridge lives in a namespace of its own, so nothing is added to the
machine's own network namespace, and deleting the namespaces deletes every interface with them.

    python scripts/netns_hosts.py up 2            # prints the tag, the namespaces and the addresses
    python scripts/netns_hosts.py exec TAG 2 -- loom launch ...   # run on host 2 of TAG
    python scripts/netns_hosts.py down TAG        # kill what runs there, delete everything
    python scripts/netns_hosts.py reap            # remove leftovers of test runs whose process died
    python scripts/netns_hosts.py up 2 --rate 100mbit --latency-ms 50   # every link limited (tc tbf)
    python scripts/netns_hosts.py limit TAG 1gbit  # change the limit of a running set
    python scripts/netns_hosts.py bytes TAG        # bytes each host's eth0 sent and received so far

A rate limit is a token-bucket filter (`tc qdisc ... tbf`) on both ends of each host's link: on the host's
eth0 (what it sends) and on the bridge's port (what it receives), so a transfer between two hosts crosses
two limited queues, one each way. `--latency-ms` bounds the queue (tbf's `latency`: how long a packet may
wait for tokens before it is dropped, the queueing delay of a full link); `--burst` is the bucket (default
10 ms of traffic, at least 32 KiB). netem's fixed delay does not work in these namespaces on every kernel:
tbf and htb do.

MPICH's mpiexec (Hydra) starts its proxies through `ssh HOST CMD`; `Hosts.ssh` is a stand-in for ssh that
runs CMD on the host of that name instead, so `HYDRA_LAUNCHER=ssh HYDRA_LAUNCHER_EXEC=<hosts.ssh>` (the
same as `mpiexec -launcher ssh -launcher-exec <hosts.ssh>`) runs a hostfile job across the namespaces.

Needs root (`ip netns add`). Names start with "loomt-" and carry a random tag, so runs side by side
never collide; the tests use `Hosts` as a context manager, which tears down even when a test fails.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "loomt-"
SUBNET = "10.77.0"
NETNS_ETC = Path("/etc/netns")  # ip netns exec mounts each file of /etc/netns/<ns>/ over the one in /etc
OWNERS = Path("/run/loomt-netns")  # <ns>.owner: the pid of the process that made the namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


_RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}


def rate_bits(text: str) -> float:
    """A tc rate ("100mbit", "1gbit", "12.5mbps": bytes) in bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"rate {text!r}: a number and one of {', '.join(_RATE_UNITS)} (tc's units), e.g. 100mbit"
        )
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class Link:
    """The limit of every host's link: tc tbf's rate, bucket (burst, bytes) and queue bound (latency)."""

    rate: str  # tc's syntax: 100mbit, 1gbit
    latency_ms: float = 50.0
    burst: int = 0  # bytes; 0: 10 ms of traffic at the rate, at least 32 KiB

    def tbf(self) -> list[str]:
        burst = self.burst or max(32 * 1024, int(rate_bits(self.rate) / 8 / 100))
        return ["tbf", "rate", self.rate, "burst", str(burst), "latency", f"{self.latency_ms}ms"]


def need_root(what: str) -> None:
    """A clear error instead of ip's or tc's "Operation not permitted" half-way through."""
    if os.geteuid() != 0:
        raise PermissionError(f"{what} needs root (ip netns add, tc qdisc); run it as root or under sudo")
    missing = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"{what} needs {', '.join(missing)} (iproute2, util-linux)")


def namespaces() -> list[str]:
    """Every network namespace on the machine (`ip netns list`), names only."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is `ns`."""
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_netns(ns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in `ns` until none is left; returns the pids that were killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = netns_pids(ns)
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} survive SIGKILL")
        time.sleep(0.05)


def delete_netns(ns: str) -> None:
    kill_netns(ns)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    (OWNERS / f"{ns}.owner").unlink(missing_ok=True)


class Hosts:
    """`n` hosts named node1..nodeN at 10.77.0.1..N (`extra` maps further names, e.g. a host that is down,
    to addresses in /etc/hosts only). Use as a context manager: `with Hosts(2) as hosts: ...`."""

    def __init__(
        self,
        n: int,
        tag: str | None = None,
        extra: dict[str, str] | None = None,
        owner: int | None = None,
        link: Link | None = None,
    ):
        if not 1 <= n <= 200:
            raise ValueError(f"1 to 200 hosts, not {n}")
        if link is not None:
            rate_bits(link.rate)  # a bad rate fails before anything is made
        self.link = link
        self.n = n
        self.tag = tag or secrets.token_hex(3)
        self.names = [f"node{i}" for i in range(1, n + 1)]
        self.extra = dict(extra or {})
        self.owner = os.getpid() if owner is None else owner  # 0: kept until `down` (manual use)
        self.switch = f"{PREFIX}{self.tag}-sw"

    def ns(self, i: int) -> str:
        """The namespace of host i (1-based, as in node1)."""
        return f"{PREFIX}{self.tag}-h{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i}"

    def hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.addr(i)} {name}" for i, name in enumerate(self.names, 1)]
        lines += [f"{addr} {name}" for name, addr in self.extra.items()]
        return "\n".join(lines) + "\n"

    def up(self) -> Hosts:
        """Create the namespaces, the bridge and the links (limited to self.link); on any failure remove what
        was made."""
        need_root("creating network-namespace hosts")
        try:
            _ip("netns", "add", self.switch)
            self._mark(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(1, self.n + 1):
                ns = self.ns(i)
                _ip("netns", "add", ns)
                self._mark(ns)
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / ns / "hosts").write_text(self.hosts_text())
                _ip(
                    "-n",
                    self.switch,
                    "link",
                    "add",
                    f"h{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                _ip("-n", self.switch, "link", "set", f"h{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"h{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            if self.link is not None:
                self.limit(self.link)
            self.ssh.write_text(
                f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} ssh {self.tag} "$@"\n'
            )
            self.ssh.chmod(0o755)
        except BaseException:
            self.down()
            raise
        return self

    def limit(self, link: Link | None) -> None:
        """Every host's link limited to `link` both ways (None: unlimited again)."""
        for i in range(1, self.n + 1):
            for ns, dev in ((self.ns(i), "eth0"), (self.switch, f"h{i}")):
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                if link is not None:
                    cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *link.tbf()]
                    done = subprocess.run(cmd, capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        self.link = link

    def link_bytes(self, i: int) -> dict[str, int]:
        """{"tx", "rx"}: bytes host i's eth0 has sent and received (the kernel's counters, frames included)."""
        out = _ip("-n", self.ns(i), "-j", "-s", "link", "show", "dev", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}

    @property
    def ssh(self) -> Path:
        """An executable that works like `ssh [-x] HOST CMD...` for the hosts of this set (for mpiexec)."""
        return OWNERS / f"{PREFIX}{self.tag}-ssh"

    def _mark(self, ns: str) -> None:
        """Record the owning process, so `reap()` can tell a crashed run's leftovers from a live run."""
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / f"{ns}.owner").write_text(str(self.owner))

    def all_ns(self) -> list[str]:
        return [self.ns(i) for i in range(1, self.n + 1)] + [self.switch]

    def down(self) -> None:
        """Kill every process on every host, delete the namespaces (their interfaces go with them)."""
        errors = []
        for ns in self.all_ns():
            try:
                delete_netns(ns)
            except Exception as e:  # keep removing the others
                errors.append(f"{ns}: {e}")
        self.ssh.unlink(missing_ok=True)
        if errors:
            raise RuntimeError("teardown incomplete: " + "; ".join(errors))

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` as run on host i: in its namespace, with its hostname (a UTS namespace of its own)."""
        return [
            "ip",
            "netns",
            "exec",
            self.ns(i),
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.names[i - 1],
            *cmd,
        ]

    def popen(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.wrap(i, cmd), **kw)

    def run(self, i: int, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(i, cmd), **kw)

    def pids(self, i: int | None = None) -> list[int]:
        """Processes on host i, or on every host."""
        hosts = [i] if i is not None else range(1, self.n + 1)
        return [pid for h in hosts for pid in netns_pids(self.ns(h))]

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process of host i (a node failure); returns their pids."""
        return kill_netns(self.ns(i))


def reap() -> list[str]:
    """Delete "loomt-" namespaces whose owning process is gone (a test run killed before its teardown)."""
    removed = []
    for ns in namespaces():
        if not ns.startswith(PREFIX):
            continue
        try:
            owner = int((OWNERS / f"{ns}.owner").read_text())
        except (OSError, ValueError):
            continue  # not ours, or being created right now
        if owner and not Path(f"/proc/{owner}").exists():
            delete_netns(ns)
            removed.append(ns)
    left = namespaces()
    for ssh in OWNERS.glob(f"{PREFIX}*-ssh"):  # the ssh stand-in of a set whose hosts are all gone
        if not any(ns.startswith(ssh.name.removesuffix("ssh")) for ns in left):
            ssh.unlink(missing_ok=True)
    return removed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="create N hosts and keep them until `down`")
    up.add_argument("n", type=int)
    up.add_argument("--tag", default=None)
    up.add_argument(
        "--rate", default=None, help="limit every link to this rate both ways (tc: 100mbit, 1gbit)"
    )
    up.add_argument(
        "--latency-ms", type=float, default=50.0, help="with --rate: the queue's bound (default 50)"
    )
    up.add_argument("--burst", type=int, default=0, help="with --rate: the bucket in bytes (default 10 ms)")
    lim = sub.add_parser("limit", help="limit the links of TAG to RATE both ways ('none': unlimited)")
    lim.add_argument("tag")
    lim.add_argument("rate")
    lim.add_argument("--latency-ms", type=float, default=50.0)
    lim.add_argument("--burst", type=int, default=0)
    nbytes = sub.add_parser("bytes", help="bytes each host of TAG sent and received (JSON)")
    nbytes.add_argument("tag")
    ex = sub.add_parser("exec", help="run a command on host I of TAG")
    ex.add_argument("tag")
    ex.add_argument("i", type=int)
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    ssh = sub.add_parser(
        "ssh", help="like ssh [-x] HOST CMD: run CMD through sh on the host named HOST of TAG"
    )
    ssh.add_argument("tag")
    ssh.add_argument("words", nargs=argparse.REMAINDER)
    down = sub.add_parser("down", help="kill everything on the hosts of TAG and delete them")
    down.add_argument("tag")
    sub.add_parser("reap", help="delete leftovers of test runs that died")
    args = p.parse_args(argv)

    def existing(tag: str) -> Hosts:
        count = sum(1 for ns in namespaces() if ns.startswith(f"{PREFIX}{tag}-h"))
        if not count:
            sys.exit(f"no hosts with tag {tag} (ip netns list)")
        return Hosts(count, tag=tag, owner=0)

    def link(rate: str | None) -> Link | None:
        return None if rate in (None, "none") else Link(rate, args.latency_ms, args.burst)

    try:
        return _verb(args, existing, link)
    except (PermissionError, ValueError, RuntimeError) as e:
        sys.exit(f"netns_hosts: {e}")


def _verb(args, existing, link) -> int:
    if args.verb == "up":
        hosts = Hosts(args.n, tag=args.tag, owner=0, link=link(args.rate)).up()
        print(f"tag {hosts.tag}")
        for i, name in enumerate(hosts.names, 1):
            print(f"{name} {hosts.addr(i)} {hosts.ns(i)}")
    elif args.verb == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return subprocess.call(existing(args.tag).wrap(args.i, cmd))
    elif args.verb == "ssh":
        words = [w for w in args.words if w != "-x"]  # ssh's "no X11 forwarding", as Hydra passes it
        hosts = existing(args.tag)
        if not words or words[0] not in hosts.names:
            sys.exit(f"ssh: no host {words[0] if words else ''!r} in {hosts.names}")
        # ssh joins the words and hands them to the remote shell: so does this
        return subprocess.call(hosts.wrap(hosts.names.index(words[0]) + 1, ["sh", "-c", " ".join(words[1:])]))
    elif args.verb == "limit":
        existing(args.tag).limit(link(args.rate))
    elif args.verb == "bytes":
        hosts = existing(args.tag)
        print(json.dumps({name: hosts.link_bytes(i) for i, name in enumerate(hosts.names, 1)}))
    elif args.verb == "down":
        existing(args.tag).down()
    else:
        print("\n".join(reap()) or "nothing to reap")
    return 0


if __name__ == "__main__":
    sys.exit(main())
