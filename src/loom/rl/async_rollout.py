"""Asynchronous rollouts (rl.max_staleness = K > 0): a rollout worker, a process of its own with a copy of the model
and a generation engine, samples the next batches while the trainer trains.

The schedule, fixed so that a run is reproducible: rollout r (0-based) is first trained on at step r*k + 1 (k =
rl.updates_per_batch), when the synchronous loop would sample it with the weights of step r*k; here it is sampled
with those of step v(r) = max(0, r*k - K): exactly K steps old, fewer at the start. Once step s is complete (at
the start of step s+1, after everything that changes weights), the trainer pushes its weights as version s if a
rollout needs them (loom.rl.weight_sync: a gloo group of the pair's own) and sends the worker every rollout whose
version is now pushed (its prompts and seeds, as the synchronous loop draws them: the same prompts and seeds for
the same rollout). The worker takes the jobs in order, waits for the version a job needs, samples it and sends back
each answer's tokens and the sampler's (behaviour) log-probabilities; the trainer scores them (rewards run in the
trainer, as in the synchronous loop) and trains with rl.is_cap's truncated importance weights against them
(loom.rl.loss). While the trainer trains step s+1 on rollout s, the worker samples rollout s+1 (K = 1): a step takes
max(sampling, training) instead of their sum. Each step records `rl/staleness` (the steps the sampling weights are
behind the trained ones), `rl/rollout_wait_s` (what the trainer waited for the worker) and the worker's own
`rl/rollout_s`.

Resume: nothing of the worker is saved. A resumed run starts a new worker with the checkpoint's weights (step s),
and every rollout not yet trained on is sampled again with them: those the interrupted run had sampled with older
weights (versions s - K .. s - 1) now have staleness below K; from the first rollout whose version is s on, the
schedule is the uninterrupted run's. The prompts and seeds of every rollout are the same (functions of the rollout
number), so only the weights of those few rollouts differ.

A job whose version has passed (train.steps raised by train.time_budget_s after it was due) takes the newest
pushed weights; its staleness, as every rollout's, is recorded as it was.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback

import torch

from loom.engine import Request, SamplingParams
from loom.errors import LoomError
from loom.rl.weight_sync import (
    WeightReceiver,
    WeightSender,
    layout,
    live_state,
    pair_group,
    pair_store,
)


def version_of(r: int, k: int, K: int) -> int:
    """The weights (optimizer steps taken) rollout r is sampled with: K steps before its first step's."""
    return max(0, r * k - K)


class AsyncRollouts:
    """The trainer's end: the worker process, the pushes, the jobs sent and the answers received."""

    def __init__(self, K: int, k: int):
        self.K, self.k = K, k
        self.ready: dict[int, tuple] = {}  # rollout -> (version, worker's seconds, answers)
        self.sent: int | None = None  # the next rollout to send (set at the first advance)
        self.outstanding = 0  # jobs sent whose answers have not come back
        self.proc = self.conn = self.sender = None
        self.waited = 0.0  # seconds the trainer waited for the worker since the last figures
        self.version = 0  # the weights the current batch was sampled with
        self.worker_s = 0.0  # and the worker's seconds for it

    # ------------------------------------------------------------------ the worker
    def start(self, spec: dict, state: dict[str, torch.Tensor], timeout_s: float) -> None:
        """Start the worker (spec: what it builds its model and engine from) and join the pair's group."""
        import multiprocessing as mp

        store = pair_store(0, True, timeout_s)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch threads or process groups
        mine, theirs = ctx.Pipe()
        spec = {**spec, "port": store.port, "rows": layout(state), "parent": os.getpid()}
        self.proc = ctx.Process(target=worker_main, args=(theirs, spec), daemon=True, name="loom-rollout")
        self.proc.start()
        theirs.close()  # the worker's end lives in the worker: its death is our EOF
        self.conn = mine
        self.sender = WeightSender(pair_group(store, 0, timeout_s), state)
        self.store = store
        self._expect("ready")

    def close(self) -> None:
        """Stop the worker (jobs it still holds are dropped: nothing trains on them)."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        self.proc = self.conn = self.sender = None

    # ------------------------------------------------------------------ the schedule
    def advance(self, steps: int, rollouts: int, last_step: int, job) -> None:
        """After `steps` optimizer steps (their weights final): send every rollout whose version is now due,
        pushing these weights first; `job(r)` gives rollout r's (prompt ids, seeds). Nothing is sent for a
        rollout first trained past `last_step`."""
        if self.sent is None:
            self.sent = rollouts
        todo = []
        while version_of(self.sent, self.k, self.K) <= steps and self.sent * self.k < last_step:
            todo.append(self.sent)
            self.sent += 1
        if not todo:
            return
        if self.sender.pushed < steps:
            self.sender.push(steps)
        for r in todo:
            prompts, seeds = job(r)
            self.conn.send(("rollout", r, version_of(r, self.k, self.K), prompts, seeds))
            self.outstanding += 1

    def take(self, r: int) -> list[Request]:
        """Rollout r's answers (waiting for the worker if they are not back yet), as the engine's requests;
        `version` and `worker_s` say which weights sampled them and in how many of the worker's seconds."""
        t0 = time.perf_counter()
        while r not in self.ready:
            self._receive()
        self.waited += time.perf_counter() - t0
        self.version, self.worker_s, (prompts, answers) = self.ready.pop(r)
        return [_request(p, a) for p, a in zip(prompts, answers, strict=True)]

    def figures(self, steps: int) -> dict:
        """The step's rl/staleness (steps between the sampling weights and those the step trained from) and
        the trainer's wait for the worker."""
        rec = {"rl/staleness": steps - self.version, "rl/rollout_wait_s": self.waited}
        self.waited = 0.0
        return rec

    # ------------------------------------------------------------------ messages
    def _receive(self) -> None:
        kind, body = self._next()
        if kind != "rollout":
            raise LoomError(f"the rollout worker sent '{kind}' where a rollout was due")
        r, version, secs, answers = body
        self.ready[r] = (version, secs, answers)
        self.outstanding -= 1
        self.sender.taken(version)

    def _expect(self, kind: str):
        got, body = self._next()
        if got != kind:
            raise LoomError(f"the rollout worker sent '{got}' where '{kind}' was due")
        return body

    def _next(self) -> tuple[str, object]:
        """The worker's next message; its error or its death raised here."""
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise LoomError(
                    f"the rollout worker (pid {self.proc.pid}) exited with code {self.proc.exitcode}",
                    hint="its error is above, if it wrote one; rl.max_staleness=0 samples in the trainer",
                )
        try:
            kind, body = self.conn.recv()
        except EOFError:
            raise LoomError(f"the rollout worker (pid {self.proc.pid}) closed its pipe") from None
        if kind == "error":
            raise LoomError(
                f"the rollout worker failed:\n{body}", hint="rl.max_staleness=0 samples in the trainer"
            )
        return kind, body


def worker_spec(stage, low: bool) -> tuple[dict, dict[str, torch.Tensor], float]:
    """(what the worker builds its model and engine from, the trainer's live weights by name, the timeout) of
    an RL stage that has begun (`low`: its steps run under bf16/fp16 autocast, the sampler's too)."""
    from loom.data.loader import doc_eot_id

    cfg, par = stage.cfg, stage.parallel
    with stage.autocast():
        dtype = torch.get_autocast_dtype(stage.device.type) if low else None
    spec = {
        "cfg": cfg,
        "meta": stage.meta,
        "data_dir": str(stage.data_dir),
        "vocab": stage.vocab,
        "device": str(stage.device),
        "eot_id": doc_eot_id(stage.data_dir, stage.meta, cfg.data.doc_mask),
        "aliases": dict(par.tied),
        "max_new": cfg.rl.max_new_tokens,
        "stop_ids": sorted(stage.template.stop_ids),
        "stops": tuple(stage.stops),
        "autocast_dtype": dtype,
        "invariant": stage.invariant,
        "threads": cfg.rl.sampler_threads or torch.get_num_threads(),
        "timeout_s": cfg.parallel.timeout_s,
    }
    return spec, live_state(par.model, par.tied), cfg.parallel.timeout_s


def _request(prompt: list[int], answer: tuple) -> Request:
    """The engine's request as the worker finished it: tokens, log-probabilities, the stop token."""
    req = Request(prompt, SamplingParams(logprobs=True))
    req.tokens, req.logprobs, req.stop_token, req.stop_logprob, reason = answer
    req.finish(reason)
    return req


# ---------------------------------------------------------------------- the worker process
def worker_main(conn, spec: dict) -> None:
    """The rollout worker: its model and engine, then jobs until the trainer closes the pipe."""
    try:
        _watch_parent(spec["parent"])
        torch.set_num_threads(spec["threads"])
        group = pair_group(pair_store(spec["port"], False, spec["timeout_s"]), 1, spec["timeout_s"])
        model = _worker_model(spec)
        weights = WeightReceiver(group, live_state(model, spec["aliases"]), spec["rows"])
        decode = _decode(spec)
        conn.send(("ready", None))
        while (job := conn.recv()) is not None:
            if job[0] == "state":  # what it holds now (test_rl_async compares it with the trainer's)
                conn.send(("state", {n: t.detach().cpu().clone() for n, t in weights.state.items()}))
                continue
            _, r, version, prompts, seeds = job
            while weights.version < version:
                weights.receive()
            t0 = time.perf_counter()
            reqs = _sample(model, spec, prompts, seeds, decode)
            answers = [(q.tokens, q.logprobs, q.stop_token, q.stop_logprob, q.finish_reason) for q in reqs]
            rows = [q.prompt for q in reqs]  # each answer's prompt (a group shares one)
            conn.send(("rollout", (r, weights.version, time.perf_counter() - t0, (rows, answers))))
    except (EOFError, BrokenPipeError):
        return  # the trainer is gone
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))


def _watch_parent(parent: int) -> None:
    """Exit when the trainer is gone (a kill -9 runs no cleanup of ours): checked every second."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="loom-rollout-parent").start()


def _worker_model(spec: dict) -> torch.nn.Module:
    """The run's single-device model (with LoRA's adapters when the run has them), on the trainer's device."""
    from loom.model.registry import spec_of

    cfg = spec["cfg"]
    model = spec_of(cfg).build_model(cfg, spec["vocab"], spec["device"], eot_id=spec["eot_id"])
    if cfg.finetune.lora_rank:
        from loom.model.lora import apply_configured

        apply_configured(model, cfg.finetune, cfg.run.seed)
    return model.requires_grad_(False)


def _decode(spec: dict):
    """The tokenizer's decode, which the engine needs to see rl.stop's texts (None without them)."""
    if not spec["stops"]:
        return None
    from loom.data.tokenizers import load_tokenizer

    return load_tokenizer(spec["data_dir"], spec["meta"]).decode


def _sample(model, spec: dict, prompts, seeds, decode) -> list[Request]:
    from loom.model.batch_invariant import batch_invariant
    from loom.rl.rollout import sample

    dtype, device = spec["autocast_dtype"], torch.device(spec["device"])

    @contextlib.contextmanager
    def sampling():  # the trainer's sampling context: its precision, batch-invariant as it is
        low = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with low, batch_invariant(spec["invariant"]):
            yield

    return sample(
        model,
        prompts,
        seeds,
        spec["max_new"],
        spec["stop_ids"],
        spec["vocab"],
        sampling,
        stops=spec["stops"],
        decode=decode,
    )
