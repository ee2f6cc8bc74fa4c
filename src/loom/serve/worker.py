"""The engine's thread: it owns loom.engine.Engine and steps it while there is work; the server's event loop
hands it requests and cancellations through an inbox (never touching the engine itself), and reads back what
the engine wrote on each request. The counters /metrics shows live here.

Nothing a request does may end the thread: a request the engine refuses or fails is failed alone (its
`error`: the server answers 500) and the others go on; a failed forward fails the requests it held. Should the
thread end for any other reason, every request it held is failed, no new one is taken (`dead`: /health answers
503), so no client waits for an answer that cannot come."""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque

from loom import log
from loom.engine import Engine, QueueFull, Request


class Draining(Exception):
    """The server is shutting down: no new requests."""


class Dead(Exception):
    """The engine's thread has ended on an error: no request can be answered."""


class Worker(threading.Thread):
    def __init__(self, engine: Engine, max_queue: int):
        super().__init__(name="loom-engine", daemon=True)
        self.engine, self.max_queue = engine, max_queue
        self.cond = threading.Condition()
        self.inbox: list[Request] = []
        self.cancels: list[Request] = []
        self.stopping = self.draining = self.aborting = False
        self.error: str | None = None  # the last failed forward's
        self.died: str | None = None  # why the thread ended, if it ended on an error
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens generated so far): tokens/s
        self.started = time.monotonic()

    # ----------------------------------------------------------------------------- the event loop's side
    def submit(self, req: Request) -> None:
        """Queue a request (Draining, QueueFull; ValueError from Engine.check for one it can never run)."""
        self.engine.check(req)
        with self.cond:
            if self.died is not None:
                raise Dead(f"the engine has stopped ({self.died})")
            if self.draining:
                raise Draining("the server is shutting down")
            if len(self.engine.waiting) + len(self.inbox) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests wait already")
            self.inbox.append(req)
            self.cond.notify()

    def cancel(self, req: Request) -> None:
        with self.cond:
            self.cancels.append(req)
            self.cond.notify()

    def stop(self, abort: bool = False) -> None:
        """End the thread once nothing runs or waits (the server has drained its requests); abort: cancel
        whatever still runs or waits first (the server's --grace is over)."""
        with self.cond:
            self.stopping = True
            self.aborting = self.aborting or abort
            self.cond.notify()

    def queue_depth(self) -> int:
        return len(self.engine.waiting) + len(self.inbox)

    def tokens_per_s(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds."""
        now, total = time.monotonic(), self.engine.generated
        recent = [(t, n) for t, n in list(self.recent) if now - t <= window]
        if not recent:
            return 0.0
        t0, n0 = recent[0]
        return (total - n0) / max(now - t0, 1e-3)

    # ----------------------------------------------------------------------------- the engine's thread
    def run(self) -> None:
        try:
            while True:
                inbox, cancels, stop = self.take()
                if stop:
                    return
                for req in inbox:  # queued first: a cancellation that came with it takes it out of the queue
                    submit_or_fail(self.engine, req)
                for req in cancels:
                    cancel_or_fail(self.engine, req)
                if self.engine.busy:
                    self._step()
        except BaseException as e:  # noqa: BLE001  (a bug: no request may wait on a thread that is gone)
            self.die(e)

    def die(self, e: BaseException) -> None:
        """The thread ends on an error: every request it held or was handed fails, none is taken after."""
        log.error(f"loom serve: the engine stopped: {e!r}\n{traceback.format_exc()}")
        with self.cond:
            self.died = repr(e)
            pending, self.inbox = [*self.engine.running, *self.engine.waiting, *self.inbox], []
        for req in pending:
            self.engine.fail(req, f"the engine stopped: {e!r}")

    def take(self, timeout: float | None = None) -> tuple[list[Request], list[Request], bool]:
        """(new requests, cancellations, whether to stop) once there is something to do (or `timeout` seconds
        have passed: nothing): the server's inbox emptied in one go."""
        with self.cond:
            while not (self.inbox or self.cancels or self.engine.busy or self.stopping):
                if not self.cond.wait(timeout):
                    break
            if self.aborting:  # --grace is over: what still runs or waits is cancelled, and the thread ends
                self.cancels += [*self.engine.running, *self.engine.waiting, *self.inbox]
                self.inbox = []
            stop = self.stopping and not (self.inbox or self.engine.busy or self.cancels)
            inbox, self.inbox = self.inbox, []
            cancels, self.cancels = self.cancels, []
        return inbox, cancels, stop

    def _step(self) -> None:
        error = step_or_fail(self.engine)
        if error is not None:
            self.error = error
        now = time.monotonic()
        self.recent.append((now, self.engine.generated))
        while self.recent and now - self.recent[0][0] > 60:
            self.recent.popleft()


def submit_or_fail(engine: Engine, req: Request) -> bool:
    """Queue a request in the engine; one it refuses is failed alone (its error), never the thread."""
    try:
        engine.submit(req, bounded=False)
        return True
    except Exception as e:  # noqa: BLE001  (whatever the request brought: Worker.submit checked it already)
        log.error(f"a request could not be queued: {e!r}")
        engine.fail(req, e)
        return False


def cancel_or_fail(engine: Engine, req: Request) -> None:
    try:
        engine.cancel(req)
    except Exception as e:  # noqa: BLE001  (its callback)
        engine.fail(req, e)


def step_or_fail(engine: Engine) -> str | None:
    """One engine step; a failed forward fails the requests it held, never the thread (the error, or None)."""
    try:
        engine.step()
    except Exception as e:
        log.error(f"generation failed: {e!r}")
        for req in [*engine.running, *engine.waiting]:
            engine.fail(req, e)
        return repr(e)
    return None
