"""Links limited for real: scripts/netns_hosts.py puts a token-bucket filter (tc tbf) on both ends of each
host's link, and `loom bench comm` run across the two hosts sees that rate.

Compared against: the limit itself. A two-rank all-reduce sends each rank's whole buffer once over its link
(busbw = algbw x 2(n-1)/n = algbw at n = 2), so busbw must be within 20 % of the rate (TCP/IP and Ethernet
headers take a few per cent of it). The veth counters (`Hosts.link_bytes`) must show at least the bytes the
benchmark moved.
"""

from __future__ import annotations

import json

import pytest
from test_multinode import PY, launch_on_hosts, wait_all

RATE_MBIT = 100
SIZE = 4 * 2**20  # 4 MiB: 0.34 s per call at 100 Mbit/s, long enough that the bucket's burst is noise


def test_bench_comm_across_a_limited_link_sees_its_rate(hosts, netns, tmp_path):
    hosts.limit(netns.Link(f"{RATE_MBIT}mbit", latency_ms=50))
    before = hosts.link_bytes(1)
    out = tmp_path / "comm.json"
    bench = [PY, "-m", "loom", "bench", "comm", "--backend", "torch", "--ops", "all_reduce"]
    bench += ["--sizes", "4MB", "--iters", "3", "--warmup", "1", "--json", str(out), "--quiet"]
    jobs = launch_on_hosts(
        hosts, "slurm", tmp_path, ["--nproc-per-node", "1", "--rdzv-timeout", "120"], bench
    )
    wait_all(jobs, 240)
    (rec,) = json.loads(out.read_text())
    seen_mbit = rec["busbw_gbps"] * 8e3  # 10^9 bytes/s -> 10^6 bits/s
    sent = hosts.link_bytes(1)["tx"] - before["tx"]
    print(f"\n[netns] tbf {RATE_MBIT} Mbit/s: all_reduce busbw {seen_mbit:.1f} Mbit/s, node1 sent {sent:,} B")
    assert seen_mbit == pytest.approx(RATE_MBIT, rel=0.2)
    assert sent >= 4 * SIZE  # warm-up + 3 timed calls, each sending the whole buffer once


def test_a_limit_needs_root_and_a_valid_rate(netns, monkeypatch):
    with pytest.raises(ValueError, match="e.g. 100mbit"):
        netns.Hosts(2, link=netns.Link("fast"))
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        netns.Hosts(2, link=netns.Link("100mbit")).up()
