"""Process-tree helpers for tests that kill or signal launched ranks, read from Linux's /proc.

On sys.path through pyproject's pytest `pythonpath`, so tests in any folder import it by name."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d.name))
                out += descendants(int(d.name))
    return out


def rank_of(pid: int) -> int | None:
    """The rank a process runs: RANK in the environment it was started with (torchrun's, mpiexec's workers),
    or the name `loom train --nproc` gives the workers its fork server makes ("loom rank N")."""
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        name = (Path("/proc") / str(pid) / "comm").read_text().strip()
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return int(name.rsplit(" ", 1)[1]) if name.startswith("loom rank ") else None


def alive(pids: list[int]) -> list[int]:
    """The pids that still exist and are not zombies."""
    out = []
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out
