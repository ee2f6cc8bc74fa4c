"""`loom serve RUN --nproc N` (or `torchrun --nproc-per-node N -m loom serve RUN`): a run served tensor-parallel,
each process holding 1/N of every layer (loom.runs.load_run_tp), rank 0 alone talking to the clients.

Every rank runs the same Engine on its shard. The forwards are collectives (two all-reduces a block, the
logits' all-gather), so the ranks must run the same forwards in the same order: their engines must hold the
same requests at every step. Rank 0's engine thread (Leader, the server's Worker) sends the others, before
each step, what changed in its requests (Message: the new ones, with their prompt ids and sampling settings,
the cancelled ones by id, the stop); each rank applies it and steps (follow). Nothing else changes an engine:
admission, the KV budget, the rows' slots follow from the same requests in the same order. Each rank then
samples the same tokens, because `Engine._forward` gathers the vocabulary-sharded logits (every rank holds
the same full logits) and each request samples with a generator of its own seed (rank 0 picks one for a
request that gives none: unseeded, each rank would draw from its own global generator). Stop texts are read
on every rank with its own copy of the tokenizer.

Why messages about requests, not forwards: the engine stays as it is (its plan, admission, the row cache)
and a message is a few ids a step. A rank that repeated rank 0's forwards would need the cache's slot
bookkeeping sent too. Each message carries what rank 0's engine holds once it is applied (its requests, its
generated tokens), which every other rank checks against its own before it steps (a forward without its pair
would wait for the timeout), and at the end every rank compares a digest of all the answers it finished: an
engine that went its own way is named instead of answering wrongly.

While idle, rank 0 sends an empty message every `heartbeat` seconds, so the others, waiting in a broadcast,
never reach the process group's timeout. The messages travel on the CPU (gloo: a GPU job's group is
`cpu:gloo,cuda:nccl`), pickled by broadcast_object_list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from loom import log
from loom.engine import Engine, Request, SamplingParams
from loom.errors import LoomError
from loom.serve.worker import Worker, cancel_or_fail, step_or_fail, submit_or_fail

CONTROL = torch.device("cpu")


@dataclass
class Message:
    """What rank 0 tells the other ranks before a step."""

    generated: int = 0  # tokens rank 0's engine has generated so far: every engine must have as many
    held: int = 0  # requests rank 0's engine holds (running and waiting) with this message applied: as many
    cancels: list[int] = field(default_factory=list)  # the ids of requests to cancel, first
    submits: list[tuple[int, list[int], SamplingParams]] = field(default_factory=list)  # (id, prompt, params)
    stop: bool = False  # the server has drained: the last message


def _broadcast(msg: Message | None) -> Message:
    box = [msg]
    dist.broadcast_object_list(box, src=0, device=CONTROL)
    return box[0]


class Mirror:
    """An engine's requests by the ids rank 0 gave them, changed only by messages; a digest of the answers."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.requests: dict[int, Request] = {}
        self.digest, self.finished = hashlib.sha256(), 0

    def apply(self, msg: Message, made: dict[int, Request] | None = None) -> None:
        """The message's cancellations, then its requests (rank 0's own objects in `made`), as each rank does."""
        for i in msg.cancels:
            if i in self.requests:
                cancel_or_fail(self.engine, self.requests[i])
        for i, prompt, params in msg.submits:
            req = made.pop(i) if made is not None else Request(prompt, params)
            self.requests[i] = req
            # a request the engine refuses fails alone, on every rank alike (never a rank: the job would stop)
            submit_or_fail(self.engine, req)

    def retire(self) -> None:
        """The finished requests folded into the digest, in id order, and forgotten."""
        for i in sorted(i for i, r in self.requests.items() if r.done):
            r = self.requests.pop(i)
            self.digest.update(repr((i, r.tokens, r.finish_reason)).encode())
            self.finished += 1

    def agree(self) -> bool:
        """Whether every rank finished the same answers (a collective: every rank calls it after the stop)."""
        mine = (self.finished, self.digest.hexdigest())
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return all(d == mine for d in every)


class Leader(Worker):
    """Rank 0's engine thread: the server's Worker, which sends each change to the other ranks before applying
    it to its own engine."""

    def __init__(self, engine: Engine, max_queue: int, heartbeat: float):
        super().__init__(engine, max_queue)
        self.mirror, self.heartbeat, self.next_id = Mirror(engine), heartbeat, 0
        self.agreed: bool | None = None  # set after the stop
        self.failure: str | None = None  # a collective failed: another rank is gone

    def run(self) -> None:
        try:
            while True:
                inbox, cancels, stop = self.take(self.heartbeat)
                msg = self.prepare(inbox, cancels, stop)
                _broadcast(msg)
                if stop:
                    break
                if self.engine.busy:
                    self._step()
                self.mirror.retire()
            self.agreed = self.mirror.agree()
        except Exception as e:  # noqa: BLE001  (whatever the collective raised: the job cannot go on)
            self._fail(repr(e))
        except BaseException as e:  # noqa: BLE001  (a bug: no request may wait on a thread that is gone)
            self.die(e)

    def prepare(self, inbox: list[Request], cancels: list[Request], stop: bool) -> Message:
        """The message of these changes, applied to rank 0's engine first: it carries what the engine then holds."""
        msg, made = self._message(inbox, cancels, stop)
        self.mirror.apply(msg, made)
        msg.generated, msg.held = self.engine.generated, held(self.engine)
        return msg

    def _message(self, inbox: list[Request], cancels: list[Request], stop: bool):
        """(the message of these changes, rank 0's requests by the ids it gives them)."""
        ids = {id(r): i for i, r in self.mirror.requests.items()}
        msg, made = Message(stop=stop), {}
        for req in cancels:
            if id(req) in ids:
                msg.cancels.append(ids[id(req)])
            else:  # never sent (its job failed to queue, or it is in this inbox): finished here alone
                self.engine.cancel(req)
        for req in inbox:
            if req.done:
                continue
            if req.params.temperature > 0 and req.params.seed is None:  # every rank draws the same
                req.params = dataclasses.replace(req.params, seed=random.getrandbits(63))
            self.next_id += 1
            made[self.next_id] = req
            msg.submits.append((self.next_id, req.prompt, req.params))
        return msg, made

    def _fail(self, error: str) -> None:
        """Every request answered with the error, no new one taken, and the server told to stop (SIGTERM)."""
        log.error(f"loom serve: the ranks lost each other ({error}); stopping")
        self.failure, self.draining = error, True
        with self.cond:
            pending, self.inbox = [*self.engine.running, *self.engine.waiting, *self.inbox], []
        for req in pending:
            req.error = error
            self.engine.cancel(req)
        os.kill(os.getpid(), signal.SIGTERM)


def held(engine: Engine) -> int:
    return len(engine.running) + len(engine.waiting)


def follow(engine: Engine, rank: int) -> bool:
    """A rank other than 0: its engine stepped as rank 0's messages say, until the stop. Whether every rank
    finished the same answers."""
    mirror = Mirror(engine)
    while True:
        msg = _broadcast(None)
        mirror.apply(msg)
        if (msg.generated, msg.held) != (engine.generated, held(engine)):  # before a forward could mismatch
            raise LoomError(
                f"rank {rank}'s engine holds {held(engine)} requests and has generated {engine.generated} tokens, "
                f"rank 0's {msg.held} and {msg.generated}: the ranks' engines went apart",
                hint="a bug: report it with the requests that were being served",
            )
        if msg.stop:
            return mirror.agree()
        if engine.busy:
            step_or_fail(engine)
        mirror.retire()


def serve_rank(run, run_dir, opts, sock, heartbeat: float) -> int:
    """This rank's part of a tensor-parallel server (run: a LoadedRun of load_run_tp's model): rank 0 serves
    HTTP on `sock`, the others follow it. The exit code: 0 once the server drained and every rank agreed."""
    from loom.serve import engine_for, run_server, served_for

    engine = engine_for(run, opts)
    if run.rank != 0:
        # rank 0's stop message ends this rank, once the server has drained: a signal here (torchrun and
        # `loom serve --nproc` pass SIGTERM to every rank) would leave rank 0 mid-collective
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        return 0 if follow(engine, run.rank) else 1
    leader = Leader(engine, opts.max_queue, heartbeat)
    log.info(f"loom serve: tensor parallel over {run.world} processes")
    run_server(served_for(run, run_dir, opts, leader), sock, opts.grace)
    leader.join(timeout=opts.grace)
    if leader.failure is not None:
        return 1
    if not leader.agreed:
        log.error(
            "loom serve: the ranks' answers differ (their digests at the end)"
            if leader.agreed is False
            else f"loom serve: requests still ran {opts.grace:.0f} s after the stop (--grace)"
        )
        return 1
    log.info(f"loom serve: the {run.world} ranks agree on all {leader.mirror.finished} answers")
    return 0
