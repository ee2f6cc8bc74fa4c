"""torchft under loom (issue 59): data-parallel replicas as replica groups that survive a member's death.

`ft.enabled=true` turns plain DDP's replicas into torchft replica groups of one process each: every group is a
1-process loom training of its own (its own store, its own run folder), and the groups meet only through
torchft: a Lighthouse keeps the quorum of live groups, a `torchft.manager.Manager` per group joins it at the
start of every step, and the gradients are averaged over the quorum's members with one all-reduce on a
reconfigurable gloo process group. A step commits only when the quorum agrees (`Manager.should_commit`); a
group that dies leaves the quorum at the next step (the lighthouse's heartbeat timeout) and the others go on;
a group started again (`loom train --nproc` restarts it, or `loom train --ft.replica_id=K` by hand) joins,
receives the weights, the optimizer, the loader's position and the step from a live peer (torchft's
PGTransport over the same process group) and continues in step.

Groups of several processes (HSDP): with `parallel.dp_impl=fsdp` (or zero2) and `parallel.dp_replicate=R`,
HSDP's replicate dimension is the replica dimension: each of the R groups is an FSDP shard group of S = nproc/R
processes (its own `loom train --nproc S` launcher, store and run folder), and each rank has a Manager of its
own (rank r of S; the group's rank 0 serves the group's manager server, which talks to the lighthouse), so the
ft process group joins rank r of every group: the gradient shards FSDP reduce-scattered within a group are
averaged across the groups, HSDP's all-reduce across replicas. A rank that dies ends its whole group (its
launcher stops the rest at once); the group is started again and each rank heals from the same rank of a live
group (its shards as plain tensors, put back on its own mesh).

Accounting while a group is missing (the choice, and why). Every group reads rows `[k*B/R, (k+1)*B/R)` of
each step's global batch of B rows (R groups: the DDP rank's slice, loom.data.slice), so a step's data is
fixed by its number. While a group is missing, its slice of those steps is *skipped*: the survivors' cursor
moves on by the whole global batch, as DDP's would, and the step's gradient is the mean over the rows the
survivors read ((R - missing) * B/R rows). Re-reading those rows would need a shared cursor and steps of
different sizes; handing them to the survivors would change their micro-batch (memory, compile) and the
rows a step reads. Skipping keeps every step's rows a function of the step, so nothing is read twice, and
it is not silent: every step records `ft_replicas` (the groups it averaged over), the running total
`ft_rows_skipped`, and every quorum change an `ft` record. The learning rate follows the step number, as
without ft. A step the quorum does not commit (a peer died inside its all-reduce) is recorded as a skipped
step (`skipped: "ft: ..."`), like a bad step: its rows are not trained on.

Exactness: with no failure the groups add the same gradients in the same order as DDP (each divided by the
number of groups first, then summed: DDP's default hook), so 2 groups equal `loom train --nproc 2` bit for
bit (tests/faults/test_ft_ddp.py). With 3 or more, gloo's ring may add in another order than DDP's buckets.
2 groups of 2 FSDP ranks equal HSDP 2 x 2 (`--nproc 4 --parallel.dp_replicate=2`) bit for bit
(tests/faults/test_ft_hsdp.py): the same reduce-scatter within a group, the same two-term sum across groups,
and every division by a power of two, exact.

What torchft cannot serve here: tensor, pipeline, context or expert parallel inside a group (their meshes
would have to be rebuilt with the group), ZeRO-1 and the MPI backend (no torch process group beside
torchft's), DDP groups of more than one process, and loom rl / dpo stages.
torchft's manager server listens on every interface (its bind is fixed at `[::]`), the lighthouse loom starts
on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import torch

from loom import log
from loom.data.slice import DataSlice
from loom.errors import LoomError

if TYPE_CHECKING:
    from loom.config import Config, Derived

REPLICA_ENV = "LOOM_FT_REPLICA"  # set by the launcher for each group it starts (ft.replica_id wins)
BARRIER_ENV = "LOOM_FT_BARRIER"  # the launcher's store where a job's first groups wait for each other
LOOPBACK = ("127.0.0.1", "localhost", "::1")


SHARDED = ("fsdp", "zero2")  # a replica group is an FSDP shard group: HSDP's replicate dim is the ft one


def sharded(cfg: Config) -> bool:
    """The groups are FSDP shard groups (HSDP's replicate dim = the replica groups), not 1-process DDP replicas."""
    return cfg.parallel.dp_impl in SHARDED


def diloco(cfg: Config) -> int:
    """DiLoCo's inner steps H (0: off): the replica groups are DiLoCo's replicas, synced once per H steps."""
    return cfg.parallel.diloco_inner_steps


def on_replicate(cfg: Config) -> bool:
    """The groups are the replicate dimension (parallel.dp_replicate) of HSDP or DiLoCo, not --nproc's count."""
    return sharded(cfg) or bool(diloco(cfg))


def in_group() -> bool:
    """This process belongs to one replica group (started by the job's launcher, or a group's own
    `loom train --nproc S` launcher): not the launcher of the whole job."""
    return REPLICA_ENV in os.environ


def groups(cfg: Config, nproc: int | None = None) -> int:
    """The number of replica groups: ft.replica_groups, else HSDP's parallel.dp_replicate (fsdp/zero2), else
    --nproc's number (one process a group)."""
    if cfg.ft.replica_groups:
        return cfg.ft.replica_groups
    return cfg.parallel.dp_replicate if on_replicate(cfg) else (nproc or 0)


def check(cfg: Config, nproc: int | None = None) -> int:
    """Every ft rule, before any process or model exists; returns the number of replica groups. `nproc`: the
    whole job's processes (its launcher); None in a group's own processes."""
    ft = cfg.ft
    n = groups(cfg, nproc)
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise LoomError("ft.enabled needs torchft", hint="pip install 'loom[ft]' (torchft 0.2)") from None
    _check_layout(cfg, n, nproc)
    if ft.min_replicas > n:
        raise LoomError(
            f"ft.min_replicas={ft.min_replicas} is more than the {n} replica groups: no step could commit",
            hint=f"--ft.min_replicas between 1 and {n}",
        )
    if nproc is not None and not ft.lighthouse and ft.timeout_s <= ft.join_timeout_s:
        raise LoomError(
            f"ft.timeout_s={ft.timeout_s:g} is not above ft.join_timeout_s={ft.join_timeout_s:g}: a group's quorum "
            "request would time out while the lighthouse may still hold that quorum for a late group",
            hint="a longer --ft.timeout_s, or a shorter --ft.join_timeout_s",
        )
    if ft.replica_id >= n:
        raise LoomError(
            f"ft.replica_id={ft.replica_id} is out of range for {n} replica groups (0..{n - 1})",
            hint=f"--ft.replica_id between 0 and {n - 1}",
        )
    if nproc is None and ft.replica_id < 0 and not in_group():
        raise LoomError(
            "ft.enabled in one process needs its replica group: --ft.replica_id=K",
            hint="loom train --nproc N --ft.enabled=true starts every group; by hand add --ft.replica_id=K "
            "--ft.replica_groups=N --ft.lighthouse=http://HOST:PORT",
        )
    if nproc is None and not ft.lighthouse and "TORCHFT_LIGHTHOUSE" not in os.environ:
        raise LoomError(
            "ft.enabled by hand needs the job's lighthouse: --ft.lighthouse=http://HOST:PORT",
            hint="the lighthouse `loom train --nproc` started (its log names it), or one the cluster runs",
        )
    return n


def _check_layout(cfg: Config, n: int, nproc: int | None) -> None:
    """The layouts torchft serves here: DDP replica groups of one process, or FSDP shard groups (HSDP's
    replicate dim = the replica groups); not tp/pp/cp inside a group (their meshes are not rebuilt when a
    group comes back), ZeRO-1 or MPI (no torch process group for torchft's manager to share)."""
    p, ft = cfg.parallel, cfg.ft
    shard, replicate = sharded(cfg), on_replicate(cfg)
    if n < 2:
        raise LoomError(
            f"ft.enabled with {n} replica group(s): fault tolerance needs at least 2 (a survivor to go on)",
            hint="--parallel.dp_replicate=2 (or more): HSDP's (dp_impl=fsdp/zero2) or DiLoCo's replicas"
            if replicate
            else "loom train --nproc 2 (or more) --ft.enabled=true, or set --ft.replica_groups=N",
        )
    if nproc is not None and not replicate and ft.replica_groups and nproc != ft.replica_groups:
        raise LoomError(
            f"--nproc {nproc} with ft.replica_groups={ft.replica_groups}: a DDP replica group is one process",
            hint=f"--nproc {ft.replica_groups}, or leave ft.replica_groups at 0; for groups of several "
            "processes use --parallel.dp_impl=fsdp --parallel.dp_replicate=GROUPS",
        )
    if nproc is not None and replicate and ft.replica_groups and p.dp_replicate not in (1, ft.replica_groups):
        raise LoomError(
            f"ft.replica_groups={ft.replica_groups} with parallel.dp_replicate={p.dp_replicate}: the replica "
            "groups are HSDP's (or DiLoCo's) replicate dimension",
            hint="leave ft.replica_groups at 0 (it is parallel.dp_replicate)",
        )
    if nproc is not None and shard and nproc % n:
        raise LoomError(
            f"--nproc {nproc} is not {n} replica groups of equal size",
            hint=f"--nproc a multiple of {n} (groups x processes per group)",
        )
    if nproc is not None and replicate and not shard and nproc != n:
        raise LoomError(
            f"--nproc {nproc} for {n} DiLoCo replica groups over DDP: a DDP replica group is one process",
            hint=f"--nproc {n}, or FSDP inside each group: --parallel.dp_impl=fsdp",
        )
    bad = [f"parallel.{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep)) if v > 1]
    if not replicate:
        bad += [f"parallel.{k}={getattr(p, k)}" for k in ("dp_shard", "dp_replicate") if getattr(p, k) > 1]
    if p.dp_impl not in ("auto", "ddp", "none", *SHARDED):
        bad.append(f"parallel.dp_impl={p.dp_impl}")
    if nproc is None and not shard and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        bad.append(f"a DDP replica group of {os.environ['WORLD_SIZE']} processes")
    if bad:
        raise LoomError(
            "ft.enabled serves DDP replica groups of one process, or FSDP shard groups across HSDP's "
            "replicate dimension (parallel.dp_impl=fsdp|zero2, parallel.dp_replicate=GROUPS), DiLoCo's replicas "
            f"either way; not {', '.join(bad)}",
            hint="drop those keys: torchft's replica groups are the data-parallel replicas",
        )


def replica_id(cfg: Config) -> int:
    """This process's replica group: ft.replica_id, else the launcher's LOOM_FT_REPLICA."""
    return cfg.ft.replica_id if cfg.ft.replica_id >= 0 else int(os.environ[REPLICA_ENV])


def group_rank() -> tuple[int, int]:
    """(this process's rank in its replica group, the group's size): its own world (an FSDP shard group)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def replica_layout(cfg: Config) -> tuple[DataSlice, Derived]:
    """This process's rows of every global batch and the batch sizes the whole job's layout would derive:
    DDP rank k of n groups, or HSDP rank k*S + r of n*S (rank r of group k, groups of S processes)."""
    from loom.config import validate

    n, k = check(cfg), replica_id(cfg)
    r, size = group_rank()
    if not in_group():  # by hand: the lighthouse checked before the model is built
        lighthouse_url(cfg.ft.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"])
    layout = as_job(cfg, n, size)
    derived = validate(layout, n * size, k * size + r)[0]
    return DataSlice(k * size + r, n * size), derived


def as_job(cfg: Config, n: int, size: int) -> Config:
    """The whole job's layout, of which each group is a replica: DDP over n processes, HSDP over n x size, or
    DiLoCo across n replicas."""
    c = as_ddp(cfg)
    if on_replicate(cfg):
        c.parallel.dp_impl, c.parallel.dp_replicate = cfg.parallel.dp_impl, n
    if sharded(cfg):
        c.parallel.dp_shard = size
    return c


def as_ddp(cfg: Config, name: str | None = None, parent: str | None = None) -> Config:
    """A copy of the config as DDP's (the batch sizes DDP derives); `name`, `parent`: another run folder."""
    import copy

    c = copy.deepcopy(cfg)
    c.parallel.dp_impl = "ddp"
    c.run.name, c.run.dir = name or c.run.name, parent or c.run.dir
    return c


def lighthouse_url(url: str) -> str:
    """http://HOST:PORT, checked reachable; one clear error otherwise (before any process starts)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname or not parts.port:
        raise LoomError(f"ft.lighthouse={url!r} is not http://HOST:PORT", hint="e.g. http://127.0.0.1:29510")
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=5.0).close()
    except OSError as e:
        raise LoomError(
            f"the torchft lighthouse at {url} is unreachable: {e}",
            hint="start it (torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510), check the address, "
            "or leave ft.lighthouse empty for loom train --nproc to start one",
        ) from None
    return f"http://{parts.hostname}:{parts.port}"


def _reachable(url: str) -> bool:
    try:
        lighthouse_url(url)
    except LoomError:
        return False
    return True


@contextlib.contextmanager
def lighthouse(cfg: Config, n: int):
    """The job's lighthouse URL: ft.lighthouse (checked reachable), else one served here on 127.0.0.1 while
    the block runs. Its heartbeat timeout decides how soon a dead group leaves the quorum; its join timeout
    how long a quorum waits for a group it has not heard from."""
    if cfg.ft.lighthouse:
        yield lighthouse_url(cfg.ft.lighthouse)
        return
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum tick at info
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=cfg.ft.min_replicas,
        join_timeout_ms=round(1000 * cfg.ft.join_timeout_s),
        quorum_tick_ms=10,
        heartbeat_timeout_ms=round(1000 * cfg.ft.heartbeat_s),  # a dead group's detection (chaos.md)
    )
    try:
        addr = server.address()
        url = f"http://127.0.0.1:{urlsplit(addr).port}"
        log.info(f"torchft lighthouse on {url} ({n} replica groups, min {cfg.ft.min_replicas})")
        yield url
    finally:
        server.shutdown()


def _status(url: str) -> str:
    """The lighthouse's status page (torchft has no query for what it shows); "" when it cannot be read."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/status", timeout=5.0) as r:
            return r.read().decode("utf-8", "replace")
    except OSError:
        return ""


def job_reached(url: str, job: str, since: float) -> int | None:
    """The step of the lighthouse's last quorum when it was this job's (replica ids `<job>_g<k>:...`) and
    formed at `since` (time.monotonic()) or later: how far the job had gone before this group asked; None
    otherwise (an older one: a finished job of the same name on a lighthouse that outlives jobs)."""
    import re

    now = time.monotonic()
    last = _status(url).split("<h2>Heartbeats</h2>")[0]
    age = re.search(r"Quorum age:\s*([0-9.]+)s", last)
    if age is None or now - float(age[1]) < since:
        return None
    members = re.findall(r"<b>\s*([^<\s]+)\s*</b>\s*<br/>\s*Step:\s*(\d+)", last)
    steps = [int(step) for rid, step in members if rid.split(":")[0].rsplit("_g", 1)[0] == job]
    return max(steps, default=None)


class JobWatch:
    """Reads the job's last quorum step from the lighthouse's page while this group asks for a quorum, once the
    request has lasted 0.1 s (an ordinary quorum returns sooner and reads nothing), then every 0.1 s: a daemon
    thread of its own, waiting between requests. The other groups' last quorum stays on the page until the
    lighthouse forms the next one, and a lone group's forms only after their heartbeats have expired, so a group
    asking while the others finish sees how far they got (the page lags the quorums by a few steps: 196 when
    they finished 200, across hosts). A process stopped inside its request reads the page as soon as it runs
    again: its thread's wait is over by then."""

    def __init__(self, url: str, job: str):
        import threading

        self.url, self.job = url, job
        self.cond = threading.Condition()
        self.request: tuple[float, float] | None = None  # (asked at, quorums formed since), monotonic
        self.seen: int | None = None
        threading.Thread(target=self._run, name="loom-ft-job", daemon=True).start()

    @contextlib.contextmanager
    def asking(self, since: float, step: int | None):
        """Around a quorum request: keeps in `seen` the highest job step of the quorums formed at `since`
        (time.monotonic()) or later, from `step`."""
        with self.cond:
            self.request, self.seen = (time.monotonic(), since), step
            self.cond.notify()
        try:
            yield self
        finally:
            with self.cond:
                self.request = None

    def _run(self) -> None:
        while True:
            with self.cond:
                while self.request is None:
                    self.cond.wait()
                request = self.request
            time.sleep(max(0.0, request[0] + 0.1 - time.monotonic()))
            while True:
                with self.cond:
                    if self.request is not request:
                        break
                step = job_reached(self.url, self.job, request[1])
                with self.cond:
                    if self.request is not request:
                        break
                    if step is not None and (self.seen is None or step > self.seen):
                        self.seen = step
                time.sleep(0.1)


def live_replicas(url: str) -> set[str]:
    """The replica ids (`<job>_g<k>`) whose managers heartbeat to the lighthouse now, read from its status
    page (a page it cannot read gives none)."""
    import re

    page = _status(url)
    beats = re.findall(r'<li class="heartbeat\s*(old)?\s*">\s*([^:\s]+):', page)
    return {rid for old, rid in beats if not old}


def refuse_live(url: str, job: str, group: int | None = None) -> None:
    """One job name per lighthouse: torchft has no notion of jobs, and two jobs of one name would train as
    one (their groups in one quorum). `group`: a group joining by hand, refused only if its number is taken."""
    live = {rid for rid in live_replicas(url) if rid.rsplit("_g", 1)[0] == job}
    if group is not None:
        live = {rid for rid in live if rid == f"{job}_g{group}"}
    if live:
        raise LoomError(
            f"the lighthouse at {url} already has a running job named {job!r} ({', '.join(sorted(live))})",
            hint="give this job another --ft.job_name (or --run.name), or stop the other one first (a group "
            "that just died is forgotten after the lighthouse's heartbeat timeout)",
        )


def job_name(cfg: Config) -> str:
    """The name the groups register under: ft.job_name, else run.name; digits at its end are kept apart
    from the group's number (torchft reads the group from the id's trailing digits)."""
    name = cfg.ft.job_name or cfg.run.name or "loom"
    return f"{name}_g"


def _start_barrier(n: int, timeout_s: float) -> None:
    """The first start of a `loom train --nproc` job: wait until every group's manager heartbeats, so that
    the first quorum holds them all (the lighthouse waits for heartbeating groups, not for ones still
    importing). Restarted groups and groups started by hand (no LOOM_FT_BARRIER) do not wait."""
    addr = os.environ.get(BARRIER_ENV)
    if not addr:
        return
    import torch.distributed as dist

    host, port = addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    store.add("ready", 1)
    deadline = time.monotonic() + timeout_s
    while int(store.add("ready", 0)) < n:
        if time.monotonic() > deadline:
            raise LoomError(
                f"torchft: not every one of the {n} replica groups started within {timeout_s:.0f}s"
            )
        time.sleep(0.05)


def _store() -> tuple[str, int, object | None]:
    """This group's TCPStore: the launcher's (MASTER_ADDR/PORT), else one served here."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return "127.0.0.1", store.port, store


def _recording_gloo(timeout: timedelta, size: int):
    """torchft's reconfigurable gloo group, noting each quorum it is configured for (its id and the groups in
    it: torchft passes global ranks, group * size + rank in group, for groups of `size` processes)."""
    from torchft.process_group import ProcessGroupGloo

    class RecordingGloo(ProcessGroupGloo):
        quorum: tuple[int, list[int]] | None = None
        order: list[int] = []

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, *args, **kw) -> None:
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kw)
            ranks = kw.get("global_ranks", args[2] if len(args) > 2 else None)
            self.order = [g // size for g in ranks or []]  # replica rank i of the quorum is group order[i]
            self.quorum = (quorum_id, sorted(self.order))

    return RecordingGloo(timeout=timeout)


def _recording_transport(pg, timeout: timedelta):
    """torchft's checkpoint transport over the groups' process group (no HTTP server of its own), noting the
    groups it sent this group's state to: a group restarted faster than the quorum noticed its death is
    seen leaving and joining only here."""
    from torchft.checkpointing.pg_transport import PGTransport

    class RecordingTransport(PGTransport):
        sent_to: list[int] = []

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)
            self.sent_to = sorted(dst_ranks)

    return RecordingTransport(pg, timeout=timeout, device=torch.device("cpu"))


def _local(t):
    """A DTensor's local shard (a view of its storage); anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _plain(tree):
    """A state dict with every DTensor as its local shard (torchft's transport would send the sender's mesh)."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_plain(v) for v in tree)
    return _local(tree)


def _like(v: torch.Tensor, own) -> torch.Tensor:
    """A received shard `v` as a DTensor on this process's mesh where `own` (the local counterpart) is one."""
    from torch.distributed.tensor import DTensor

    if not isinstance(own, DTensor) or not isinstance(v, torch.Tensor):
        return v
    return DTensor.from_local(v, own.device_mesh, own.placements, shape=own.shape, stride=own.stride())


def _on_mesh(received: dict, own: dict) -> dict:
    return {k: _like(v, own.get(k)) for k, v in received.items()}


def _optim_on_mesh(received: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state dict of plain shards, its per-parameter tensors put on their parameter's mesh (the
    state dict numbers the parameters in param_groups order; a fresh optimizer has no state to go by)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {
        i: {k: _like(v, params[i]) if getattr(v, "shape", ()) != () else v for k, v in st.items()}
        for i, st in received["state"].items()
    }
    return {**received, "state": state}


class QuorumLost(LoomError):
    """This group got no quorum within ft.timeout_s while the lighthouse answers: it was cut off from the
    others (a partition, a stopped process) for longer than that. Exit 1, a crash, not a user error: the
    launcher starts the group again and it heals from a live peer."""

    code = 1


class JobFinished(LoomError):
    """A group that came back (restarted, or started by hand) after the job's other groups finished the run:
    alone in its quorum, it would train the run again by itself. Exit 0: nothing failed, nothing is left."""

    code = 0


class FtReplica:
    """One replica group's torchft Manager, driven by the trainer: `begin_step` (quorum, healing), `sync_grads`
    (the gradient mean over the quorum), `commit` (the quorum's agreement), `records` (what metrics.jsonl gets)."""

    def __init__(self, cfg: Config, trainer, url: str | None = None):
        ft = cfg.ft
        self.cfg, self.trainer, self.n, self.k = cfg, trainer, check(cfg), replica_id(cfg)
        self.rows_per_group = cfg.train.batch_size // self.n
        url = self.url = url or lighthouse_url(ft.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"])
        self.job = job_name(cfg).removesuffix("_g")
        if not in_group():  # a group started by hand: its number must be free
            refuse_live(url, self.job, self.k)
        self.timeout_s = ft.timeout_s
        timeout = timedelta(seconds=ft.timeout_s)
        self.rank, self.size = group_rank()
        self.pg = _recording_gloo(timeout, self.size)
        self.transport = _recording_transport(self.pg, timeout)
        self.manager = None  # made at the first step (join)
        self.h, self.diloco = diloco(cfg), trainer.parallel.diloco
        if self.diloco is not None:  # DiLoCo's outer step averages over the quorum's groups
            self.diloco.outer_mean = self.outer_mean
        self.quorum: tuple[int, list[int]] | None = None
        self.rows_skipped, self.healed_s, self.undone = 0, None, 0  # undone: DiLoCo windows not committed
        self.quorum_s = 0.0  # the last quorum's wait (in the step's time; DiLoCo: a window's first step)
        self.asked = 0.0  # when (time.monotonic()) this group's last quorum came back
        self.step_ok = True  # whether the quorum committed this group's last step
        self.pending: list[dict] = []

    def join(self) -> None:
        """This group's Manager, made when the group is about to ask for its first quorum, not before: from
        its first heartbeat the lighthouse counts the group as live, and a quorum that is not the previous
        one's (after a failure) waits up to its join timeout (ft.join_timeout_s) for every live group to ask.
        A restarted group heartbeating while it still built its model or read its checkpoint could hold the
        survivors' quorum that long. With train.compile a group coming into a running job (restarted, or
        started by hand: no start barrier) first compiles its step on a batch it throws away (Trainer.warm_up):
        else its first step compiles inside the quorum, and the survivors wait in its all-reduce."""
        from torchft.manager import Manager

        ft, timeout = self.cfg.ft, timedelta(seconds=self.timeout_s)
        if self.cfg.train.compile and not os.environ.get(BARRIER_ENV):  # into a running job: compile first
            log.info(
                f"torchft: replica group {self.k} compiled its step before joining "
                f"({self.trainer.warm_up():.1f}s, a forward and backward thrown away)"
            )
        self.job_step = job_reached(self.url, self.job, time.monotonic() - self.timeout_s)
        host, port, self._own_store = _store()
        local = urlsplit(self.url).hostname in LOOPBACK
        try:
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,  # heal before the step's batch is read: the peer's loader position
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                heartbeat_interval=timedelta(seconds=min(0.1, ft.heartbeat_s / 10)),
                rank=self.rank,  # the group's rank 0 runs its manager server, which talks to the lighthouse
                world_size=self.size,
                store_addr=host,
                store_port=port,
                lighthouse_addr=self.url,
                replica_id=f"{job_name(self.cfg)}{self.k}",
                hostname="127.0.0.1" if local else socket.gethostname(),
                checkpoint_transport=self.transport,
                init_sync=False,  # every group initialises the same weights from run.seed
            )
        except Exception as e:  # the lighthouse went away between the check and here
            raise LoomError(f"torchft could not join the lighthouse at {self.url}: {e}") from None
        self.manager.register_state_dict_fn("loom", self._load, self._state)
        self.watch = JobWatch(self.url, self.job)
        _start_barrier(self.n * self.size, ft.timeout_s)

    # ---------------------------------------------------------------- the state a healing group receives
    def _state(self) -> dict:
        """What a restarted group's process of the same rank receives (FSDP: this rank's shards, as plain
        tensors: the receiver puts them on its own mesh)."""
        t = self.trainer
        return {
            "model": _plain(t.model.state_dict()),
            "optim": _plain(t.optimizer.state_dict()),
            "loader": t.batches.state_dict(),
            "step": t.step,
            "rows_skipped": self.rows_skipped,
            "diloco_momentum": list(self.diloco.momentum) if self.diloco is not None else [],
        }

    def _load(self, state: dict) -> None:
        t = self.trainer
        t.model.load_state_dict(_on_mesh(state["model"], t.model.state_dict()))
        t.optimizer.load_state_dict(_optim_on_mesh(state["optim"], t.optimizer))
        t.batches.load_state_dict(state["loader"])
        t.step, self.rows_skipped = int(state["step"]), int(state["rows_skipped"])
        if self.diloco is not None:  # healed at a window's start: the weights are the anchor
            self.diloco.reanchor()
            for mine, theirs in zip(self.diloco.momentum, state["diloco_momentum"], strict=True):
                mine.copy_(theirs)
        self.healed_s = time.perf_counter()

    # ---------------------------------------------------------------- each step
    def begin_step(self) -> None:
        """Join this step's quorum (waits for it); a group behind the others heals here from a live peer.
        DiLoCo: only at a window's first step (after an outer step, where the replicas are equal). The trainer
        calls `join` before the first (outside the step's timed wait: a group may compile there)."""
        if self.h and self.trainer.step % self.h:
            self.quorum_s = 0.0
            return
        t0, before = time.perf_counter(), self.trainer.step
        self.healed_s, self.transport.sent_to = None, []
        prev = self.quorum[0] if self.quorum else None
        if prev is None:  # the first: what join read of the job, quorums at most ft.timeout_s old
            since, step = time.monotonic() - self.timeout_s, self.job_step
        else:  # the quorums formed since this group's last one: the job's own
            since, step = self.asked, job_reached(self.url, self.job, self.asked) if self._away() else None
        try:
            with self.watch.asking(since, step) as watch:
                self.manager.start_quorum()
        except Exception as e:  # the lighthouse (or this group's manager server) no longer answers
            if _reachable(self.url):
                raise QuorumLost(
                    f"torchft: replica group {self.k} got no quorum before step {self.trainer.step + 1} "
                    f"within ft.timeout_s={self.timeout_s:g}s (cut off from the other groups for longer than "
                    f"that?): {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                    hint="loom train --nproc starts the group again and it heals from a live peer; started by "
                    "hand, run the same command with --train.resume=auto",
                ) from None
            raise LoomError(
                f"torchft: replica group {self.k} lost the lighthouse at {self.url} before step "
                f"{self.trainer.step + 1}: {str(e).splitlines()[0]}",
                hint="start a lighthouse, then the same command with --train.resume=auto continues each group "
                "from its newest checkpoint",
            ) from None
        self.quorum_s, self.asked = time.perf_counter() - t0, time.monotonic()
        if (
            self.pg.quorum != self.quorum
        ):  # a new quorum (every rank of the group alike): is it a lone one behind?
            self.job_step = self._agreed(watch.seen)
            self._not_alone_behind(prev)
        if self.pg.quorum != self.quorum or self.transport.sent_to:
            self._quorum_changed(before, self.quorum_s)

    def _away(self) -> bool:
        """Whether the others may have gone on without this group since its last quorum: its last step failed
        (a peer died, or this group was cut off in it), or it did not ask for longer than the lighthouse's
        heartbeat timeout (stopped, cut off between steps). Then it reads the lighthouse's page once before it
        asks (the others may have finished long before: its lone quorum would then form at once); an ordinary
        step reads nothing."""
        return not self.step_ok or time.monotonic() - self.asked > self.cfg.ft.heartbeat_s

    def _agreed(self, seen: int | None) -> int | None:
        """The highest step the group's ranks saw of the job (each polled the page on its own): they stop, or
        go on, together."""
        if self.size == 1:
            return seen
        import torch.distributed as dist

        t = torch.tensor([-1 if seen is None else seen], device=self.trainer.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the group's own world
        return None if int(t.item()) < 0 else int(t.item())

    def _not_alone_behind(self, prev: int | None) -> None:
        """This group's quorum holds only itself while the job's other groups went on without it: they are gone,
        finished (a group restarted shortly before the end, or cut off until after it, is back after it) or all
        dead. The lighthouse cannot tell finished groups from dead ones and gave it a quorum of its own; it stops
        instead of training the run again alone (chaos.md: a kill at step 180 of 200). Two signs:
        - the job's step it saw (the lighthouse's last quorum of the job: for a first quorum at most
          ft.timeout_s old, later one formed since this group's last) is ahead of its own. Near the end (within
          max(10, 5 %) of the steps: the page lags the quorums by a few steps) that is the run finished: exit 0;
        - with nothing seen (the process stopped inside its request until after they had finished and their
          heartbeats had expired), quorums formed between its last one (`prev`) and this: the lighthouse's
          quorum id moves on once per change of members or commit failures. It cannot tell finished from dead.
        A group left alone by its peers' deaths is not behind them (they were in its last quorum, at its step;
        the id moves by one) and goes on."""
        steps, step, seen = self.cfg.train.steps, self.trainer.step, self.job_step
        if self.pg.quorum is None or self.pg.quorum[1] != [self.k] or step >= steps:
            return
        hint = "continue every group from its newest checkpoint (the same commands with --train.resume=auto)"
        if seen is not None and seen > step:
            if steps - seen <= max(10, steps // 20):
                raise JobFinished(
                    f"torchft: replica group {self.k} came back at step {step} after the job's other groups "
                    f"finished the run (the last quorum it saw was at step {seen} of {steps}); not training it "
                    "again alone",
                    hint="nothing to do: the run's weights are in the groups that finished (their last checkpoints)",
                )
            raise LoomError(
                f"torchft: replica group {self.k} came back at step {step} alone: the job's other groups, at step "
                f"{seen} moments ago, are gone (all died?); not training on alone from behind",
                hint=hint,
            )
        now = self.pg.quorum[0]
        if prev is not None and now - prev >= 2:
            raise LoomError(
                f"torchft: replica group {self.k} came back at step {step} alone: the job's other groups went on "
                f"without it (quorums {prev + 1} to {now - 1}) and are gone, finished or dead; not training on "
                "alone from behind",
                hint=f"if they finished, nothing is left to do; else {hint}",
            )

    def _quorum_changed(self, before: int, quorum_s: float) -> None:
        old = set(self.quorum[1]) if self.quorum else set()
        self.quorum = self.pg.quorum
        live, order = self.quorum[1], self.pg.order
        # the replica ranks torchft sent to, as group numbers: a peer this group healed had restarted
        sent = sorted(order[r] for r in self.transport.sent_to if r < len(order))
        rec = {
            "step": self.trainer.step,
            "ft": {
                "quorum_id": self.quorum[0],
                "replicas": live,
                "joined": sorted((set(live) - old) | set(sent)),
                "left": sorted(old - set(live)),
                "quorum_s": round(quorum_s, 4),
                "healed_peers": sent,  # the restarted groups that received this group's state
            },
        }
        if self.healed_s is not None:
            rec["ft"].update(healed_from=before, heal_s=round(quorum_s, 4))
        self.pending.append(rec)
        (log.warn if old else log.info)(
            f"torchft: replica group {self.k} at step {self.trainer.step}: quorum {self.quorum[0]} of groups "
            f"{live}" + (f" (healed in {quorum_s:.2f}s)" if self.healed_s is not None else "")
        )

    def sync_grads(self, model: torch.nn.Module, loss_sum: torch.Tensor | None = None) -> None:
        """The gradients' mean over the quorum's groups: one flat all-reduce, each divided first (DDP's order).
        FSDP groups: each rank's shards (already the group's mean, reduce-scattered), with the same shard rank of
        every group, as HSDP's all-reduce across replicas. `loss_sum` (this process's summed loss, one element)
        rides along and becomes the groups' mean in place, so the step's recorded loss is the job's."""
        if self.h:  # DiLoCo: the inner steps are each group's own (its loss too); outer_mean syncs
            return
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        extra = [] if loss_sum is None else [loss_sum.detach().float().reshape(1)]
        if not grads and not extra:
            return
        flat = torch.cat([g.reshape(-1) for g in grads] + extra)
        flat.div_(self.manager.num_participants())
        from torch.distributed import ReduceOp

        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        if loss_sum is not None:
            loss_sum.copy_(flat[-1].to(loss_sum.dtype).reshape(loss_sum.shape))

    def commit(self, local_ok: bool) -> bool:
        """Whether this step's update is applied: every group of the quorum agrees (a group that skips the
        step for its own reason makes the others skip it too, so the replicas never differ)."""
        if self.h:  # DiLoCo: an inner step is this group's alone; the quorum commits outer steps
            return local_ok
        if not local_ok:
            self.manager.report_error(RuntimeError("this group skipped the step"))
        return self._committed()

    def _committed(self) -> bool:
        """The quorum's agreement on this step; not committed, this group's process group is dropped at once
        (a commit failure changes the next quorum's id, so torchft configures a new one there anyway). A peer
        still inside the step's collective waiting on this group, not on the dead one, then fails now: left
        in it, that peer is alive and not asking for the next quorum, and the lighthouse holds the quorum its
        join timeout for it (chaos.md: a 10 s stall after a kill, 3 groups)."""
        self.step_ok = self.manager.should_commit()
        if not self.step_ok:
            self.pg.abort()
        return self.step_ok

    def outer_mean(self, delta: torch.Tensor) -> bool:
        """DiLoCo's outer gradient made the mean over the quorum's groups in place (summed, then divided:
        loom.parallel.diloco's order), and whether the quorum commits it; not committed (a group failed in
        the window or its all-reduce), the caller undoes the window."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(delta, reduce_op=ReduceOp.SUM).wait()
        live = self.manager.num_participants()
        delta.div_(live)
        if self._committed():
            return True
        # not silent: the window's rows (every live group's) were read and are not trained on
        self.undone += 1
        self.rows_skipped += live * self.rows_per_group * self.h
        log.warn(
            f"torchft: replica group {self.k}: the outer step at step {self.trainer.step} was not committed "
            f"(a group failed in its window); the window's {self.h} steps are undone"
        )
        return False

    def records(self, rec: dict) -> list[dict]:
        """The step's ft keys (added to `rec`) and the quorum-change records to write before it."""
        live = self.manager.num_participants()
        self.rows_skipped += (self.n - live) * self.rows_per_group
        rec.update(ft_replicas=live, ft_rows_skipped=self.rows_skipped, ft_quorum_s=round(self.quorum_s, 5))
        if self.undone:
            rec["ft_windows_undone"] = self.undone
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
