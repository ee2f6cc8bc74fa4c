"""A rendezvous for `loom train --nproc N`: one node, and a store that listens on 127.0.0.1 only.

torch's c10d and static rendezvous create their TCPStore servers on every network interface, whatever
host name they are given, so a local run would accept connections from the network. This handler binds
the listening socket to loopback itself and hands it to the TCPStore (`master_listen_fd`); the elastic
agent then shares that store with its workers (MASTER_ADDR=127.0.0.1), and the gloo/NCCL connections the
workers open to each other follow MASTER_ADDR. It is registered with torch's public handler registry under
BACKEND. Each round (the first start, and every restart of the worker group) gets a fresh store, as
torch's workers expect: they do not prefix their keys per attempt.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

BACKEND = "loom-loopback"
HOST = "127.0.0.1"


class LoopbackRendezvous(RendezvousHandler):
    """Every worker is on this machine; the store is this process's, on 127.0.0.1."""

    def __init__(self, params: RendezvousParameters):
        self._run_id = params.run_id
        self._closed = False
        self._timeout = datetime.timedelta(seconds=float(params.get("timeout", 600)))
        self._sock: socket.socket | None = None
        self._store: dist.TCPStore | None = None

    def _new_store(self) -> tuple[dist.TCPStore, int]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((HOST, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            HOST,
            port,
            is_master=True,
            master_listen_fd=sock.fileno(),
            wait_for_workers=False,
            multi_tenant=True,
            timeout=self._timeout,
        )
        # Both kept for the store's lifetime: the TCPStore serves on the socket's file descriptor.
        old = self._sock
        self._sock, self._store = sock, store
        if old is not None:
            old.close()
        return store, port

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        store, port = self._new_store()
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(HOST, port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


def _create(params: RendezvousParameters) -> LoopbackRendezvous:
    return LoopbackRendezvous(params)


def register() -> str:
    """Make BACKEND known to torch's launcher (idempotent); returns its name for LaunchConfig."""
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND
