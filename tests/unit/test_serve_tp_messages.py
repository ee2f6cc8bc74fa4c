"""loom.serve.tp's messages without processes: rank 0's Leader turns the server's requests and cancellations into
messages, and an engine that applies only the messages (a follower's, here in the same process on the same
weights) holds the same requests and samples the same tokens at every step as rank 0's own. Compared against:
rank 0's engine, step by step (the two-process server itself: tests/distributed/test_serve_tp.py)."""

from __future__ import annotations

import torch

from loom.engine import CANCELLED, Engine, Request, SamplingParams
from loom.model.gpt.gpt import GPT, GPTConfig
from loom.serve.tp import Leader, Mirror, held


def engine() -> Engine:
    torch.manual_seed(0)
    return Engine(
        GPT(GPTConfig(vocab_size=61, n_layer=1, n_head=2, n_embd=32, block_size=64)).eval(), max_seqs=3
    )


def test_a_follower_that_applies_the_messages_samples_what_rank_0_samples():
    leader, follower = Leader(engine(), max_queue=8, heartbeat=30), Mirror(engine())
    follower.engine.model.load_state_dict(leader.engine.model.state_dict())
    torch.manual_seed(123)  # unseeded requests: rank 0's seed, not either process's global generator
    reqs = [
        Request([i + 1, 2, 3], SamplingParams(max_tokens=6 + i, temperature=0.0 if i == 0 else 1.0))
        for i in range(5)
    ]
    inbox, cancels, sent = list(reqs[:3]), [], []
    for step in range(40):
        if step == 2:
            inbox, cancels = (
                reqs[3:],
                [reqs[1]],
            )  # a request cancelled mid-answer; more than max_seqs=3 running
        msg = leader.prepare(inbox, cancels, stop=False)
        sent.append(msg)
        follower.apply(msg)
        inbox, cancels = [], []
        assert (msg.generated, msg.held) == (follower.engine.generated, held(follower.engine))
        for m in (leader.mirror, follower):
            if m.engine.busy:
                m.engine.step()
            m.retire()
    assert not leader.engine.busy and not follower.engine.busy
    assert reqs[1].finish_reason == CANCELLED and all(r.done for r in reqs)
    assert (leader.mirror.finished, leader.mirror.digest.hexdigest()) == (5, follower.digest.hexdigest())
    submitted = [p for msg in sent for _, _, p in msg.submits]
    assert submitted[0].seed is None and all(p.seed is not None for p in submitted[1:])  # greedy needs none


def test_a_request_cancelled_before_it_was_sent_is_never_sent():
    leader = Leader(engine(), max_queue=8, heartbeat=30)
    req = Request([1, 2], SamplingParams(max_tokens=4, seed=5))
    msg, made = leader._message([req], [req], stop=False)  # its job failed to queue: submitted and cancelled
    assert msg.submits == [] and msg.cancels == [] and made == {}
    assert req.finish_reason == CANCELLED and req.params.seed == 5


def test_a_request_cancelled_while_it_waits_in_the_inbox_never_runs():
    """One-process serving: a client gone before the engine's thread took its request (request and cancellation
    taken in one go) gets no forward, and the request ends cancelled without tokens."""
    import time

    from loom.serve.worker import Worker

    worker = Worker(engine(), max_queue=8)
    req = Request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    with worker.cond:  # the thread takes both at once
        worker.submit(req)
        worker.cancel(req)
        worker.start()
    deadline = time.monotonic() + 10
    while not req.done and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.stop()
    worker.join(10)
    assert req.finish_reason == CANCELLED and req.tokens == [] and worker.engine.forwards == 0


def test_a_request_the_engine_refuses_fails_alone_on_every_rank():
    """A request past Worker.submit's checks that the engine still refuses (a seed no generator takes) fails
    alone, on rank 0 and on a follower alike: never the engine's thread (the ranks would lose each other)."""
    leader, follower = Leader(engine(), max_queue=8, heartbeat=30), Mirror(engine())
    bad = Request([1, 2], SamplingParams(max_tokens=4, temperature=1.0, seed=2**64))
    good = Request([3, 4], SamplingParams(max_tokens=4, temperature=0.0))
    msg = leader.prepare([bad, good], [], stop=False)
    follower.apply(msg)
    assert bad.done and bad.error and "seed" in bad.error and not good.done
    assert (msg.generated, msg.held) == (follower.engine.generated, held(follower.engine)) == (0, 1)
    for m in (leader.mirror, follower):
        m.engine.drain()
        m.retire()
    assert good.tokens and (leader.mirror.finished, leader.mirror.digest.hexdigest()) == (
        2,
        follower.digest.hexdigest(),
    )
