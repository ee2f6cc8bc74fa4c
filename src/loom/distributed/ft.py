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

What torchft cannot serve here: tensor, pipeline or context parallel, FSDP/ZeRO, HSDP and DiLoCo layouts
and the MPI backend (the groups are one process each: plain DDP replicas), and loom rl / dpo stages.
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


def groups(cfg: Config, nproc: int | None = None) -> int:
    """The number of replica groups: ft.replica_groups, else --nproc's number."""
    return cfg.ft.replica_groups or (nproc or 0)


def check(cfg: Config, nproc: int | None = None) -> int:
    """Every ft rule, before any process or model exists; returns the number of replica groups."""
    ft, p = cfg.ft, cfg.parallel
    n = groups(cfg, nproc)
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise LoomError("ft.enabled needs torchft", hint="pip install 'loom[ft]' (torchft 0.2)") from None
    if nproc is not None and cfg.ft.replica_groups and nproc != cfg.ft.replica_groups:
        raise LoomError(
            f"--nproc {nproc} with ft.replica_groups={cfg.ft.replica_groups}: each replica group is one process",
            hint=f"--nproc {cfg.ft.replica_groups}, or leave ft.replica_groups at 0",
        )
    if n < 2:
        raise LoomError(
            f"ft.enabled with {n} replica group(s): fault tolerance needs at least 2 (a survivor to go on)",
            hint="loom train --nproc 2 (or more) --ft.enabled=true, or set --ft.replica_groups=N",
        )
    bad = [f"parallel.{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp)) if v > 1]
    bad += [f"parallel.{k}={getattr(p, k)}" for k in ("dp_shard", "dp_replicate") if getattr(p, k) > 1]
    if p.dp_impl not in ("auto", "ddp", "none"):
        bad.append(f"parallel.dp_impl={p.dp_impl}")
    if getattr(p, "diloco", False):
        bad.append("parallel.diloco")
    if bad:
        raise LoomError(
            f"ft.enabled serves plain DDP replica groups of one process here; not {', '.join(bad)}",
            hint="drop those keys (torchft's replica groups are the data-parallel replicas)",
        )
    if ft.min_replicas > n:
        raise LoomError(
            f"ft.min_replicas={ft.min_replicas} is more than the {n} replica groups: no step could commit",
            hint=f"--ft.min_replicas between 1 and {n}",
        )
    if ft.replica_id >= n:
        raise LoomError(
            f"ft.replica_id={ft.replica_id} is out of range for {n} replica groups (0..{n - 1})",
            hint=f"--ft.replica_id between 0 and {n - 1}",
        )
    if nproc is None and ft.replica_id < 0 and REPLICA_ENV not in os.environ:
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


def replica_id(cfg: Config) -> int:
    return cfg.ft.replica_id if cfg.ft.replica_id >= 0 else int(os.environ[REPLICA_ENV])


def replica_layout(cfg: Config) -> tuple[DataSlice, Derived]:
    """This group's rows of every global batch (its DDP rank's slice) and the batch sizes DDP would derive."""
    from loom.config import validate

    n, k = check(cfg), replica_id(cfg)
    if REPLICA_ENV not in os.environ:  # by hand: the lighthouse checked before the model is built
        lighthouse_url(cfg.ft.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"])
    layout = as_ddp(cfg)
    derived = validate(layout, n, k)[0]
    return DataSlice(k, n), derived


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
        join_timeout_ms=10000,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=2000,
    )
    try:
        addr = server.address()
        url = f"http://127.0.0.1:{urlsplit(addr).port}"
        log.info(f"torchft lighthouse on {url} ({n} replica groups, min {cfg.ft.min_replicas})")
        yield url
    finally:
        server.shutdown()


def live_replicas(url: str) -> set[str]:
    """The replica ids (`<job>_g<k>`) whose managers heartbeat to the lighthouse now, read from its status
    page (torchft has no query for them; a page it cannot read gives none)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/status", timeout=5.0) as r:
            page = r.read().decode("utf-8", "replace")
    except OSError:
        return set()
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


def _recording_gloo(timeout: timedelta):
    """torchft's reconfigurable gloo group, noting each quorum it is configured for (its id and the groups in
    it: with one process per group, the global ranks torchft passes are the groups' numbers)."""
    from torchft.process_group import ProcessGroupGloo

    class RecordingGloo(ProcessGroupGloo):
        quorum: tuple[int, list[int]] | None = None
        order: list[int] = []

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, *args, **kw) -> None:
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, *args, **kw)
            ranks = kw.get("global_ranks", args[2] if len(args) > 2 else None)
            self.order = list(ranks or [])  # replica rank i of the quorum is group order[i]
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


class QuorumLost(LoomError):
    """This group got no quorum within ft.timeout_s while the lighthouse answers: it was cut off from the
    others (a partition, a stopped process) for longer than that. Exit 1, a crash, not a user error: the
    launcher starts the group again and it heals from a live peer."""

    code = 1


class FtReplica:
    """One replica group's torchft Manager, driven by the trainer: `begin_step` (quorum, healing), `sync_grads`
    (the gradient mean over the quorum), `commit` (the quorum's agreement), `records` (what metrics.jsonl gets)."""

    def __init__(self, cfg: Config, trainer, url: str | None = None):
        from torchft.manager import Manager

        ft = cfg.ft
        self.trainer, self.n, self.k = trainer, check(cfg), replica_id(cfg)
        self.rows_per_group = cfg.train.batch_size // self.n
        url = self.url = url or lighthouse_url(ft.lighthouse or os.environ["TORCHFT_LIGHTHOUSE"])
        if REPLICA_ENV not in os.environ:  # a group started by hand: its number must be free
            refuse_live(url, job_name(cfg).removesuffix("_g"), self.k)
        self.timeout_s = ft.timeout_s
        timeout = timedelta(seconds=ft.timeout_s)
        self.pg = _recording_gloo(timeout)
        self.transport = _recording_transport(self.pg, timeout)
        host, port, self._own_store = _store()
        local = urlsplit(url).hostname in LOOPBACK
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
                rank=0,
                world_size=1,
                store_addr=host,
                store_port=port,
                lighthouse_addr=url,
                replica_id=f"{job_name(cfg)}{self.k}",
                hostname="127.0.0.1" if local else socket.gethostname(),
                checkpoint_transport=self.transport,
                init_sync=False,  # every group initialises the same weights from run.seed
            )
        except Exception as e:  # the lighthouse went away between the check and here
            raise LoomError(f"torchft could not join the lighthouse at {url}: {e}") from None
        self.manager.register_state_dict_fn("loom", self._load, self._state)
        _start_barrier(self.n, ft.timeout_s)
        self.quorum: tuple[int, list[int]] | None = None
        self.rows_skipped, self.healed_s = 0, None
        self.pending: list[dict] = []

    # ---------------------------------------------------------------- the state a healing group receives
    def _state(self) -> dict:
        t = self.trainer
        return {
            "model": t.model.state_dict(),
            "optim": t.optimizer.state_dict(),
            "loader": t.batches.state_dict(),
            "step": t.step,
            "rows_skipped": self.rows_skipped,
        }

    def _load(self, state: dict) -> None:
        t = self.trainer
        t.model.load_state_dict(state["model"])
        t.optimizer.load_state_dict(state["optim"])
        t.batches.load_state_dict(state["loader"])
        t.step, self.rows_skipped = int(state["step"]), int(state["rows_skipped"])
        self.healed_s = time.perf_counter()

    # ---------------------------------------------------------------- each step
    def begin_step(self) -> None:
        """Join this step's quorum (waits for it); a group behind the others heals here from a live peer."""
        t0, before = time.perf_counter(), self.trainer.step
        self.healed_s, self.transport.sent_to = None, []
        try:
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
        if self.pg.quorum != self.quorum or self.transport.sent_to:
            self._quorum_changed(before, time.perf_counter() - t0)

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
        `loss_sum` (this group's summed loss, one element) rides along and becomes the groups' mean in place,
        so the step's recorded loss is the job's, as DDP records it."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
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
        if not local_ok:
            self.manager.report_error(RuntimeError("this group skipped the step"))
        return self.manager.should_commit()

    def records(self, rec: dict) -> list[dict]:
        """The step's ft keys (added to `rec`) and the quorum-change records to write before it."""
        live = self.manager.num_participants()
        self.rows_skipped += (self.n - live) * self.rows_per_group
        rec.update(ft_replicas=live, ft_rows_skipped=self.rows_skipped)
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        self.manager.shutdown(wait=False)
