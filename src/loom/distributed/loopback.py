"""The store of `loom train --nproc N`: one node, served by the launching process on 127.0.0.1 only.

torch's c10d and static rendezvous create their TCPStore servers on every network interface, whatever
host name they are given, so a local run would accept connections from the network. `listen` binds the
listening socket to loopback itself and hands it to the TCPStore (`master_listen_fd`); the workers join it
as torchrun's workers join their agent's store (MASTER_ADDR=127.0.0.1, TORCHELASTIC_USE_AGENT_STORE), and
the gloo/NCCL connections they open to each other follow MASTER_ADDR. Each round (the first start, and
every restart of the workers) gets a fresh store, as torch's workers expect: they do not prefix their keys
per attempt.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator

import torch.distributed as dist

HOST = "127.0.0.1"


@contextlib.contextmanager
def listen(timeout_s: float) -> Iterator[int]:
    """A TCPStore served by this process on 127.0.0.1 while the block runs; yields its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    port, fd = sock.getsockname()[1], sock.detach()
    try:  # the TCPStore serves on the socket's file descriptor and closes it when it goes
        store = dist.TCPStore(
            HOST,
            port,
            is_master=True,
            master_listen_fd=fd,
            wait_for_workers=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=float(timeout_s)),
        )
    except BaseException:
        os.close(fd)
        raise
    try:
        yield port
    finally:
        del store
