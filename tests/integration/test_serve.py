"""`loom serve` against the official `openai` client over a real socket on 127.0.0.1: the answers against
`loom chat --prompt` and loom.engine run alone, the OpenAI shapes (streaming, logprobs, n, stop), every bad
input the issue lists answered with its status and an OpenAI-shaped error, a client that leaves mid-stream,
a full queue, load from 32 clients, and SIGTERM with requests in flight (a `loom serve` process).

Most tests talk to a server in a thread of this process (the same app, worker and uvicorn as the command; its
engine reachable, so a test can slow its steps down or look at its rows); the SIGTERM test starts the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from loom.cli import main
from loom.engine import Engine, Request, SamplingParams
from loom.env import detect_env
from loom.runs import open_run
from loom.serve import ServeOptions, served_for, serving_in_thread

KEY = "sk-test"
PROMPT = "reverse: apple river"


@pytest.fixture(scope="module")
def runs(sft):
    """A chat run (a few SFT steps on the base run) and its base run (no chat tokens)."""
    from sftkit import _sft_args

    assert main(_sft_args(sft, "chat", "--train.steps=6")) == 0
    return sft / "runs" / "chat", sft / "runs" / "base"


@contextlib.contextmanager
def serving(run_dir, **options):
    """A loom serve app on 127.0.0.1 in a thread: (base URL, Served)."""
    with open_run(run_dir, torch.device("cpu"), detect_env()) as run:
        served = served_for(run, run_dir, ServeOptions(**options))
        with serving_in_thread(served) as port:
            yield f"http://127.0.0.1:{port}/v1", served


@pytest.fixture(scope="module")
def chat_server(runs):
    with serving(runs[0], api_key=KEY, max_seqs=8, max_queue=64) as (url, served):
        yield url, served


@pytest.fixture
def client(chat_server):
    return openai.OpenAI(base_url=chat_server[0], api_key=KEY, max_retries=0, timeout=20)


def slow_steps(served, seconds: float):
    """Each engine step takes at least `seconds` (a long answer stays in flight); undone by the returned call."""
    engine = served.worker.engine
    step = engine.step

    def slow():
        step()
        time.sleep(seconds)

    engine.step = slow
    return lambda: setattr(engine, "step", step)


def settled(served, timeout: float = 5.0) -> bool:
    """Whether the engine holds no row and no reservation within `timeout` seconds."""
    engine = served.worker.engine
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not engine.running and not engine.waiting and engine.reserved == 0 and not served.worker.inbox:
            return True
        time.sleep(0.02)
    return False


def chat(client, content=PROMPT, **kw):
    return client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": content}], **{"max_tokens": 20, **kw}
    )


# ------------------------------------------------------------------------------------------ answers
def test_greedy_chat_equals_loom_chat_prompt(client, runs, capsys):
    got = chat(client, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert main(["chat", str(runs[0]), "--prompt", PROMPT, "--max-new-tokens", "20", "--device", "cpu"]) == 0
    assert got.choices[0].message.content == capsys.readouterr().out[:-1]
    assert got.usage.completion_tokens == len(got.choices[0].message.content)  # a char tokenizer: a char each
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_streamed_chat_is_the_whole_answer_in_pieces(client):
    whole = chat(client, temperature=0).choices[0]
    chunks = list(chat(client, temperature=0, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(pieces) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage.completion_tokens == len(whole.message.content)


def test_completion_with_logprobs(client):
    got = client.completions.create(model="chat", prompt="apple ", max_tokens=10, temperature=0, logprobs=3)
    c = got.choices[0]
    assert got.object == "text_completion" and "".join(c.logprobs.tokens) == c.text
    assert len(c.logprobs.token_logprobs) == len(c.text) and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    for token, lp, top in zip(
        c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp)  # greedy: the sampled one is the top
        assert top[token] == pytest.approx(lp)
    assert c.logprobs.text_offset == list(range(len(c.text)))


def test_n_choices_sampled_with_seeds(client):
    got = chat(client, temperature=1.0, n=3, seed=5, max_tokens=12)
    assert [c.index for c in got.choices] == [0, 1, 2]
    again = chat(client, temperature=1.0, n=3, seed=5, max_tokens=12)
    assert [c.message.content for c in got.choices] == [c.message.content for c in again.choices]
    assert 3 <= got.usage.completion_tokens <= 3 * 12  # every choice counted (each at most 12 tokens)
    assert len({c.message.content for c in got.choices}) > 1  # seed + i: the choices differ


def test_stop_text_ends_the_answer_before_it(client):
    free = client.completions.create(model="chat", prompt="apple ", max_tokens=20, temperature=0).choices[0]
    stop = free.text[5:7]
    got = client.completions.create(model="chat", prompt="apple ", max_tokens=20, temperature=0, stop=[stop])
    assert got.choices[0].text == free.text[: free.text.index(stop)]
    assert got.choices[0].finish_reason == "stop"


def test_a_base_run_serves_completions_and_refuses_chat(runs):
    with serving(runs[1]) as (url, _):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=20)
        assert c.completions.create(model="base", prompt="apple", max_tokens=5, temperature=0).choices[0].text
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}])
        assert e.value.code == "chat_not_supported" and "base model" in e.value.message
        assert "/v1/completions" in e.value.message


# ------------------------------------------------------------------------------------------ bad input
def test_malformed_json_is_400_in_the_openai_shape(chat_server):
    r = httpx.post(
        chat_server[0] + "/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and "JSON" in r.json()["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    assert [m.id for m in client.models.list()] == ["chat"]


def test_wrong_or_missing_api_key_is_401(chat_server):
    c = openai.OpenAI(base_url=chat_server[0], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    # no key at all (the openai client always sends one): a bare request
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(chat_server[0] + "/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(chat_server[0].removesuffix("/v1") + "/health").json()["status"] == "ok"


@pytest.mark.parametrize(
    "kw,code",
    [
        ({"max_tokens": 0}, None),
        ({"max_tokens": -3}, None),
        ({"max_tokens": 60}, "context_length_exceeded"),  # 22 prompt tokens + 60 > 64
        ({"n": 0}, None),
        ({"temperature": -1}, None),
        ({"top_logprobs": 3}, None),  # without logprobs
    ],
)
def test_impossible_requests_are_400(client, kw, code):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert e.value.code == code


def test_a_1mb_prompt_is_400_without_encoding_it(client, chat_server):
    t = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="chat", prompt="apple " * 175_000, max_tokens=5)
    assert e.value.code == "context_length_exceeded" and time.perf_counter() - t < 5
    assert settled(chat_server[1])


def test_a_client_that_leaves_mid_stream_frees_its_row(client, chat_server):
    served = chat_server[1]
    restore = slow_steps(served, 0.02)
    cancelled = []
    cancel = served.worker.cancel
    served.worker.cancel = lambda req: (cancelled.append(req), cancel(req))
    try:
        alone = chat(client, content="reverse: stone cloud", temperature=0, max_tokens=30).choices[0]
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(chat, client, "reverse: stone cloud", temperature=0, max_tokens=30)
            body = {"model": "chat", "prompt": "apple ", "max_tokens": 40, "temperature": 0, "stream": True}
            with httpx.stream(
                "POST", chat_server[0] + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
            ) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # the answer has begun; the client leaves
            assert other.result(timeout=20).choices[0].message.content == alone.message.content
        assert settled(served)
        assert any(req.finish_reason == "cancelled" and len(req.tokens) < 40 for req in cancelled)
    finally:
        served.worker.cancel = cancel
        restore()


def test_a_full_queue_is_429(runs):
    with serving(runs[0], max_seqs=1, max_queue=1) as (url, served):
        restore = slow_steps(served, 0.05)
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=20)
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(chat, c, max_tokens=15, temperature=0)
            while not served.worker.engine.running:
                time.sleep(0.01)
            waiting = pool.submit(chat, c, max_tokens=5, temperature=0)
            while served.worker.queue_depth() < 1:
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as e:
                chat(c, max_tokens=5)
            assert e.value.code == "queue_full"
            assert running.result(timeout=20).choices[0].message.content is not None
            assert waiting.result(timeout=20).choices[0].finish_reason in ("stop", "length")
        restore()
        metrics = httpx.get(url.removesuffix("/v1") + "/metrics").text
        assert 'loom_requests_total{route="/v1/chat/completions",status="429"} 1' in metrics
        assert "loom_queue_depth 0" in metrics


def test_32_clients_x_10_requests_each_get_their_own_answer(client, chat_server):
    """Load: every answer is the one its prompt gets alone from the engine (nothing lost or mixed up)."""
    words = "apple river stone cloud green house music paper light table".split()
    prompts = [f"reverse: {words[i % 10]} {words[(i // 10) % 10]} {words[i // 100]}" for i in range(320)]
    engine = chat_server[1].worker.engine
    template = chat_server[1].template
    greedy = SamplingParams(8, 0.0, stop_ids=frozenset(template.stop_ids))
    alone = [Request(template.prompt([{"role": "user", "content": p}]), greedy) for p in prompts]
    want = Engine(engine.model, max_seqs=64, vocab_size=engine.vocab).run(alone)

    def one_client(k: int) -> list[str]:
        answers = [chat(client, prompts[10 * k + i], temperature=0, max_tokens=8) for i in range(10)]
        return [a.choices[0].message.content for a in answers]

    with ThreadPoolExecutor(32) as pool:
        got = [a for answers in pool.map(one_client, range(32)) for a in answers]
    decode = chat_server[1].decode
    assert got == [decode(r.tokens) for r in want]
    assert settled(chat_server[1])


# ------------------------------------------------------------------------------------------ SIGTERM
def test_sigterm_finishes_the_requests_in_flight_and_exits_0(runs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loom",
            "serve",
            str(runs[1]),
            "--port",
            "0",
            "--device",
            "cpu",
            "--grace",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        url = _served_url(proc)
        body = {"model": "base", "prompt": "apple ", "max_tokens": 50, "temperature": 0, "stream": True}
        started = threading.Barrier(4)

        def stream() -> list[dict]:
            events = []
            with httpx.stream("POST", url + "/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 1:
                            started.wait()
            return events

        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream) for _ in range(3)]
            started.wait(timeout=30)  # three answers under way
            proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=30) for f in streams]
        assert proc.wait(timeout=30) == 0
        for events in answers:
            text = "".join(e["choices"][0]["text"] for e in events)
            assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop") and text
        assert (
            len({"".join(e["choices"][0]["text"] for e in ev) for ev in answers}) == 1
        )  # greedy: one answer
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _served_url(proc: subprocess.Popen) -> str:
    for line in proc.stdout:
        if "loom serve:" in line and "http://" in line:
            return "http://" + line.split("http://")[1].split()[0]  # .../v1
    raise AssertionError("loom serve printed no address")
