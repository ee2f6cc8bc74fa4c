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


def until(cond, request, what: str, timeout: float = 30.0) -> None:
    """Wait for `cond`; fail (not hang) when it has not held within `timeout` s or `request` ended first."""
    end = time.monotonic() + timeout
    while not cond():
        if request.done():
            raise AssertionError(f"waiting for {what}, the request ended first: {request.result()!r}")
        assert time.monotonic() < end, f"{what}: not seen within {timeout:.0f} s"
        time.sleep(0.01)


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
        # each engine step 0.25 s: the first answer (which may stop after a token or two) holds the one slot
        # long enough to be seen running on a loaded machine
        restore = slow_steps(served, 0.25)
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(chat, c, max_tokens=15, temperature=0)
            until(lambda: served.worker.engine.running, running, "the first request to run")
            waiting = pool.submit(chat, c, max_tokens=5, temperature=0)
            until(lambda: served.worker.queue_depth() >= 1, waiting, "the second request to queue")
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


# ------------------------------------------------------------------------------------------ issue 57: faults
def _health(url: str) -> httpx.Response:
    return httpx.get(url.removesuffix("/v1") + "/health", timeout=10)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_outside_64_bits_is_400_and_the_server_goes_on(client, chat_server, seed):
    """Such a seed once killed the engine's thread (the generator seeded outside its error handling): this
    request and every later one never answered while /health said ok."""
    quick = client.with_options(timeout=10)
    with pytest.raises(openai.BadRequestError) as e:
        quick.completions.create(model="chat", prompt="apple ", max_tokens=3, seed=seed)
    assert e.value.param == "seed" and "2**64" in e.value.message
    assert (
        quick.completions.create(model="chat", prompt="apple ", max_tokens=3, temperature=0).choices[0].text
    )
    assert _health(chat_server[0]).json()["status"] == "ok"


def test_seeds_at_the_ends_of_the_range_sample(client):
    """2**64 - 1 with n = 2: choice 1's seed wraps to 0 (the generator reads a seed mod 2**64, as it reads a
    negative one), so the choices are those of the seeds they name."""
    quick = client.with_options(timeout=10)
    top = quick.completions.create(model="chat", prompt="apple ", max_tokens=8, seed=2**64 - 1, n=2)
    low = quick.completions.create(model="chat", prompt="apple ", max_tokens=8, seed=-1, n=1)
    zero = quick.completions.create(model="chat", prompt="apple ", max_tokens=8, seed=0, n=1)
    assert [c.text for c in top.choices] == [low.choices[0].text, zero.choices[0].text]
    least = quick.completions.create(model="chat", prompt="apple ", max_tokens=8, seed=-(2**63))
    assert least.choices[0].finish_reason in ("length", "stop")


def test_a_request_the_engine_fails_fails_alone_and_later_ones_answer(client, chat_server):
    """Any exception inside the engine's loop (here: queuing one request) fails that request (500, OpenAI
    shape), never the thread."""
    engine = chat_server[1].worker.engine
    submit = engine.submit

    def broken(req, bounded=True):
        if req.params.max_tokens == 7:
            raise RuntimeError("broken on purpose")
        return submit(req, bounded)

    engine.submit = broken
    try:
        quick = client.with_options(timeout=10)
        with pytest.raises(openai.InternalServerError) as e:
            quick.completions.create(model="chat", prompt="apple ", max_tokens=7)
        assert "broken on purpose" in e.value.message
        later = quick.completions.create(model="chat", prompt="apple ", max_tokens=5, temperature=0)
        assert later.choices[0].text
    finally:
        engine.submit = submit
    assert _health(chat_server[0]).json()["status"] == "ok" and settled(chat_server[1])


def test_a_dead_engine_is_503_on_health_and_requests(runs):
    """Should the engine's thread ever end on an error, /health says so (503) and requests answer 503 at once."""
    with serving(runs[1]) as (url, served):
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=10)
        take = served.worker.take
        calls = []

        def dying(timeout=None):
            calls.append(1)
            if len(calls) > 1:
                raise RuntimeError("the thread dies on purpose")
            return take(timeout)

        served.worker.take = dying
        # the thread waits in the unpatched take: this request wakes it, and its next take ends it
        c.completions.create(model="base", prompt="apple", max_tokens=2, temperature=0)
        served.worker.join(10)
        assert not served.worker.is_alive()
        r = _health(url)
        assert r.status_code == 503 and r.json()["status"] == "dead" and "on purpose" in r.json()["error"]
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="base", prompt="apple", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "engine_dead"


def test_an_empty_api_key_is_refused_before_loading(capsys, monkeypatch, tmp_path):
    """`--api-key="$UNSET"` once served without any key; the run need not even exist for the refusal."""
    missing = str(tmp_path / "no-run")
    assert main(["serve", missing, "--api-key=", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--api-key is empty" in err and "no-run" not in err
    monkeypatch.setenv("LOOM_API_KEY", "  ")
    assert main(["serve", missing, "--port", "0"]) == 2
    assert "LOOM_API_KEY is empty" in capsys.readouterr().err
    with pytest.raises(Exception, match="API key is empty"):
        ServeOptions(api_key="")


def test_a_host_beyond_loopback_without_a_key_is_warned_about(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("LOOM_API_KEY", raising=False)
    missing = str(tmp_path / "no-run")
    main(["serve", missing, "--host", "0.0.0.0", "--port", "0"])  # the warning, then the missing run
    out = capsys.readouterr().out
    assert "warning: --host 0.0.0.0" in out and "no --api-key" in out
    main(["serve", missing, "--port", "0"])
    main(["serve", missing, "--host", "0.0.0.0", "--port", "0", "--api-key", "sk-x"])
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-300])
def test_a_tiny_temperature_is_greedy(client, temperature):
    """Logits over 1e-40 overflow float32: the softmax was NaN and the draw the last id ('' for the API)."""
    greedy = client.completions.create(model="chat", prompt="apple ", max_tokens=12, temperature=0)
    tiny = client.completions.create(model="chat", prompt="apple ", max_tokens=12, temperature=temperature)
    assert greedy.choices[0].text and tiny.choices[0].text == greedy.choices[0].text


def test_loom_generate_and_chat_at_a_tiny_temperature_are_greedy(runs, capsys):
    base = ["generate", str(runs[1]), "--prompt", "apple ", "--max-new-tokens", "12", "--device", "cpu"]
    assert main([*base, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main([*base, "--temperature", "1e-40"]) == 0
    assert capsys.readouterr().out == greedy and greedy.strip()
    chat = ["chat", str(runs[0]), "--prompt", PROMPT, "--max-new-tokens", "12", "--device", "cpu"]
    assert main([*chat, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main([*chat, "--temperature", "1e-40"]) == 0
    assert capsys.readouterr().out == greedy and greedy.strip()


def test_a_client_that_leaves_a_whole_answer_request_frees_its_row(client, chat_server):
    """Not streamed: the route polls request.is_disconnected(), which a `@app.middleware("http")` once hid (the
    row then generated every token after its client had gone)."""
    served = chat_server[1]
    restore = slow_steps(served, 0.1)  # 40 tokens: 4 s at least; the client leaves after 0.5 s
    cancelled = []
    cancel = served.worker.cancel
    served.worker.cancel = lambda req: (cancelled.append(req), cancel(req))
    try:
        body = {"model": "chat", "prompt": "apple ", "max_tokens": 40, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                chat_server[0] + "/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=httpx.Timeout(10, read=0.5),
            )
        assert settled(served, timeout=20)
        assert any(r.finish_reason == "cancelled" and len(r.tokens) < 40 for r in cancelled)
    finally:
        served.worker.cancel = cancel
        restore()


# ------------------------------------------------------------------------------------------ issue 57: edges
def test_a_character_outside_the_vocabulary_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="chat", prompt="apple \u2603", max_tokens=3)
    assert e.value.param == "prompt" and "\u2603" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, content="snow \u2603")
    assert e.value.param == "messages"


def test_a_deeply_nested_body_is_400_json(chat_server):
    r = httpx.post(
        chat_server[0] + "/completions",
        content=b"[" * 200_000 + b"]" * 200_000,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_an_internal_error_is_an_openai_shaped_500(chat_server, monkeypatch):
    from loom.serve import protocol

    def broken(*a, **k):
        raise RuntimeError("a bug on purpose")

    monkeypatch.setattr(protocol, "response", broken)
    body = {"model": "chat", "prompt": "apple ", "max_tokens": 2}
    r = httpx.post(chat_server[0] + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["type"] == "server_error" and "a bug on purpose" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("logit_bias", {"5": 10}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("best_of", 3),
        ("echo", True),
        ("suffix", "end"),
        # (response_format is built: test_serve_structured.py; tools on chat: test_serve_tools.py)
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
    ],
)
def test_a_field_that_would_change_the_answer_and_is_not_built_is_400(chat_server, field, value):
    body = {"model": "chat", "prompt": "apple ", "max_tokens": 2, field: value}
    r = httpx.post(chat_server[0] + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert r.json()["error"]["code"] == "unsupported_field"


def test_neutral_values_of_those_fields_are_accepted_and_top_k_samples(client):
    neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "best_of": 1}
    got = client.completions.create(model="chat", prompt="apple ", max_tokens=8, temperature=0, **neutral)
    top1 = client.completions.create(
        model="chat", prompt="apple ", max_tokens=8, temperature=1.5, seed=3, extra_body={"top_k": 1}
    )
    assert top1.choices[0].text == got.choices[0].text  # top_k 1 is greedy at any temperature


def test_completions_on_a_chat_run_stop_at_a_chat_token(client, chat_server):
    """High temperature, many choices: the chat tokens are drawn; each ends its choice, never shows as text."""
    from loom.data.chat import CHAT_TOKENS

    got = client.completions.create(
        model="chat", prompt="reverse: apple", max_tokens=40, temperature=2.0, n=16, seed=11
    )
    texts = [c.text for c in got.choices]
    assert not any(t in text for text in texts for t in CHAT_TOKENS)
    assert any(c.finish_reason == "stop" for c in got.choices)


def test_the_served_checkpoint_is_in_v1_models(client):
    card = client.models.list().data[0]
    assert card.checkpoint["step"] == 6 and card.checkpoint["path"].endswith("step_000006")


def test_bad_grace_port_and_host_are_one_error_each(runs, capsys):
    import socket

    assert main(["serve", str(runs[1]), "--grace", "-1"]) == 2
    assert "--grace must be" in capsys.readouterr().err
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = str(taken.getsockname()[1])
        assert main(["serve", str(runs[1]), "--port", port, "--device", "cpu"]) != 0
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1 port {port}" in err and "Traceback" not in err
    assert main(["serve", str(runs[1]), "--host", "no-such-host.invalid", "--port", "0"]) != 0
    err = capsys.readouterr().err
    assert "--host no-such-host.invalid: it does not resolve" in err and "Traceback" not in err


def test_an_ipv6_host_prints_a_url_with_brackets():
    from loom.serve import bind, url_of

    assert url_of("::1", 8000) == "http://[::1]:8000/v1"
    assert url_of("127.0.0.1", 8000) == "http://127.0.0.1:8000/v1"
    sock = bind("::1", 0)
    try:
        assert sock.getsockname()[0] == "::1"
    finally:
        sock.close()


def _serve_process(run_dir, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "loom", "serve", str(run_dir), "--port", "0", "--device", "cpu", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_ctrl_c_exits_0_and_the_log_names_the_checkpoint(runs):
    proc = _serve_process(runs[1], "--host", "::1")
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "http://" in line:
                break
        assert "http://[::1]:" in lines[-1]
        assert any("checkpoint" in line and "step_" in line and "(step " in line for line in lines)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


GRACE_SCRIPT = """
import sys, time, torch
from loom.env import detect_env
from loom.runs import open_run
from loom.serve import ServeOptions, bind, run_server, served_for
run_dir = sys.argv[1]
with open_run(run_dir, torch.device("cpu"), detect_env()) as run:
    served = served_for(run, run_dir, ServeOptions(grace=1))
    engine = served.worker.engine
    step = engine.step
    a = torch.randn(256, 256)
    def slow():  # a long answer: 0.3 s a token, spent inside torch
        step()
        t = time.monotonic()
        while time.monotonic() - t < 0.3:
            a @ a
    engine.step = slow
    sock = bind("127.0.0.1", 0)
    print(f"loom serve: on http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    run_server(served, sock, 1.0)
    print("exited cleanly", flush=True)
"""


def test_an_expired_grace_cancels_what_runs_and_exits_cleanly(runs):
    """SIGTERM with an answer that outlasts --grace: it is cancelled, the engine's thread ends, exit 0 (the
    process once left with the thread inside a forward and died of SIGABRT)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", GRACE_SCRIPT, str(runs[1])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = _served_url(proc)
        body = {"model": "base", "prompt": "apple ", "max_tokens": 50, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # under way: 50 tokens would take 15 s
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(httpx.HTTPError):
                for _ in lines:
                    pass
        assert proc.wait(timeout=60) == 0
        assert "exited cleanly" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
