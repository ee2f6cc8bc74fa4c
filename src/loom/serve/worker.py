"""The engine's thread: it owns loom.engine.Engine and steps it while there is work; the server's event loop
hands it requests and cancellations through an inbox (never touching the engine itself), and reads back what
the engine wrote on each request. The counters /metrics shows live here."""

from __future__ import annotations

import threading
import time
from collections import deque

from loom import log
from loom.engine import Engine, QueueFull, Request


class Draining(Exception):
    """The server is shutting down: no new requests."""


class Worker(threading.Thread):
    def __init__(self, engine: Engine, max_queue: int):
        super().__init__(name="loom-engine", daemon=True)
        self.engine, self.max_queue = engine, max_queue
        self.cond = threading.Condition()
        self.inbox: list[Request] = []
        self.cancels: list[Request] = []
        self.stopping = self.draining = False
        self.error: str | None = None
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens generated so far): tokens/s
        self.started = time.monotonic()

    # ----------------------------------------------------------------------------- the event loop's side
    def submit(self, req: Request) -> None:
        """Queue a request (Draining, QueueFull; ValueError from Engine.check for one it can never run)."""
        self.engine.check(req)
        with self.cond:
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

    def stop(self) -> None:
        """End the thread once nothing runs or waits (the server has drained its requests)."""
        with self.cond:
            self.stopping = True
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
        while True:
            inbox, cancels, stop = self.take()
            if stop:
                return
            for req in inbox:  # queued first: a cancellation that came with it takes it out of the queue
                self.engine.submit(req, bounded=False)
            for req in cancels:
                self.engine.cancel(req)
            if self.engine.busy:
                self._step()

    def take(self, timeout: float | None = None) -> tuple[list[Request], list[Request], bool]:
        """(new requests, cancellations, whether to stop) once there is something to do (or `timeout` seconds
        have passed: nothing): the server's inbox emptied in one go."""
        with self.cond:
            while not (self.inbox or self.cancels or self.engine.busy or self.stopping):
                if not self.cond.wait(timeout):
                    break
            stop = self.stopping and not (self.inbox or self.engine.busy)
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


def step_or_fail(engine: Engine) -> str | None:
    """One engine step; a failed forward fails the requests it held, never the thread (the error, or None)."""
    try:
        engine.step()
    except Exception as e:
        log.error(f"generation failed: {e!r}")
        for req in [*engine.running, *engine.waiting]:
            req.error = repr(e)
            engine.cancel(req)
        return repr(e)
    return None
