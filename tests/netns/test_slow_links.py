"""Links limited for real: scripts/netns_hosts.py puts a token-bucket filter (tc tbf) on both ends of each
host's link, and `loom bench comm` run across the two hosts sees that rate.

Compared against: the limit itself and the same link unlimited. A two-rank all-reduce sends each rank's whole
buffer once over its link (busbw = algbw x 2(n-1)/n = algbw at n = 2), so busbw can never exceed the rate by
more than the bucket's burst and the timer's noise (10 %), and the limited link must be several times slower
than the unlimited one measured in the same test. No lower bound near the rate: with other jobs on the machine
the ranks themselves fall behind the link (72.9 Mbit/s measured under a 100 Mbit/s limit), which says nothing
about the limit. The veth counters (`Hosts.link_bytes`) must show at least the bytes the benchmark moved.
"""

from __future__ import annotations

import json

import pytest
from test_multinode import PY, launch_on_hosts, wait_all

RATE_MBIT = 100
SIZE = 4 * 2**20  # 4 MiB: 0.34 s per call at 100 Mbit/s, long enough that the bucket's burst is noise


def _bench_mbit(hosts, tmp_path, name: str) -> float:
    """`loom bench comm`'s all-reduce busbw across the two hosts, in Mbit/s."""
    out = tmp_path / f"{name}.json"
    (tmp_path / name).mkdir()
    bench = [PY, "-m", "loom", "bench", "comm", "--backend", "torch", "--ops", "all_reduce"]
    bench += ["--sizes", "4MB", "--iters", "3", "--warmup", "1", "--json", str(out), "--quiet"]
    jobs = launch_on_hosts(
        hosts, "slurm", tmp_path / name, ["--nproc-per-node", "1", "--rdzv-timeout", "120"], bench
    )
    wait_all(jobs, 240)
    (rec,) = json.loads(out.read_text())
    return rec["busbw_gbps"] * 8e3  # 10^9 bytes/s -> 10^6 bits/s


def test_bench_comm_across_a_limited_link_sees_its_rate(hosts, netns, tmp_path):
    free = _bench_mbit(hosts, tmp_path, "free")
    hosts.limit(netns.Link(f"{RATE_MBIT}mbit", latency_ms=50))
    before = hosts.link_bytes(1)
    seen = _bench_mbit(hosts, tmp_path, "limited")
    sent = hosts.link_bytes(1)["tx"] - before["tx"]
    print(
        f"\n[netns] unlimited {free:.1f} Mbit/s; tbf {RATE_MBIT} Mbit/s: {seen:.1f} Mbit/s, node1 sent {sent:,} B"
    )
    assert 0 < seen <= RATE_MBIT * 1.1  # the limit holds: never faster than the rate
    assert seen * 3 <= free  # and it is the limit that holds it: the same link unlimited is far faster
    assert sent >= 4 * SIZE  # warm-up + 3 timed calls, each sending the whole buffer once


def test_a_limit_needs_root_and_a_valid_rate(netns, monkeypatch):
    with pytest.raises(ValueError, match="e.g. 100mbit"):
        netns.Hosts(2, link=netns.Link("fast"))
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        netns.Hosts(2, link=netns.Link("100mbit")).up()
