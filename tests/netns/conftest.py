"""Hosts for multi-node tests: network namespaces joined by a bridge (scripts/netns_hosts.py).

Each test gets two fresh hosts, node1 (10.77.0.1) and node2 (10.77.0.2), plus a name node3 (10.77.0.3)
that every host's /etc/hosts knows but no machine answers: a host that is down. Whatever a test leaves
running is killed and every namespace deleted when it ends, passed or failed; leftovers of a run that was
itself killed (no teardown) are reaped at the next start.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _netns_hosts():
    spec = importlib.util.spec_from_file_location("netns_hosts", ROOT / "scripts" / "netns_hosts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netns_hosts", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def netns():
    """scripts/netns_hosts.py as a module (its Link, rate parsing, errors), without making any host."""
    return _netns_hosts()


@pytest.fixture
def hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns add); CI runs these tests as root")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (iproute2, util-linux)")
    netns = _netns_hosts()
    netns.reap()
    with netns.Hosts(2, extra={"node3": "10.77.0.3"}) as h:
        yield h
