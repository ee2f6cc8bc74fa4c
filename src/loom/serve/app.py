"""The HTTP side of `loom serve`: a FastAPI app with the OpenAI routes, /health and /metrics, over one Worker.

Requests are read by hand (loom.serve.protocol), not by pydantic models, so that every refusal (malformed
JSON included) is the OpenAI-shaped error body, and so is a real internal error (a catch-all 500: no request
ever gets a plain-text one). Streaming answers are server-sent events; a client that leaves mid-answer cancels
its rows at once (the stream's task is cancelled by the server and its `finally` tells the worker), and a
client that leaves a whole-answer request is noticed within a quarter second (`request.is_disconnected()`:
requests are counted by a pure ASGI middleware, because Starlette's `@app.middleware("http")` hands the route
a receive channel that never reports the disconnect).

FastAPI is an optional dependency (`loom[serve]`): it is imported where the app is built and answers, so this
module imports without it. No `from __future__ import annotations` here: FastAPI reads a route's `Request`
annotation as the class itself, which build_app's local import provides (a string would be looked up in
this module's globals).
"""

import asyncio
import hmac
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loom import log
from loom.engine import QueueFull, SamplingParams
from loom.serve import protocol
from loom.serve.protocol import APIError, Job, bad
from loom.serve.tools import StreamState, chat_messages, read_tools, stream_delta
from loom.serve.tools import grammar as tool_grammar
from loom.serve.worker import Dead, Draining, Worker


@dataclass
class Served:
    """What the routes need: the worker, the model's name and context, its tokenizer and chat template."""

    worker: Worker
    model: str
    context: int
    tokenizer: object
    template: object | None  # None: a base model (no chat tokens): completions only
    eot_id: int
    api_key: str | None = None
    longest_token_chars: int = 1  # a prompt of more characters than this x context is refused before encoding
    counts: Counter = field(default_factory=Counter)  # (route, status) -> requests
    checkpoint: dict = field(default_factory=dict)  # the served checkpoint: {"path", "step"} (/v1/models)
    _grammars: object = None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def grammars(self):
        """The tokenizer's bridge to the grammar library (loom.serve.grammar), made on the first use."""
        if self._grammars is None:
            from loom.serve.grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.worker.engine.vocab)
        return self._grammars


def build_app(served: Served) -> "FastAPI":  # noqa: F821
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="loom serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(served, request, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods
        return _error(served, request, APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal_error(
        request: Request, e: Exception
    ):  # a bug: still the OpenAI shape, never plain text
        log.error(f"loom serve: {request.method} {request.url.path} failed: {e!r}")
        return _error(served, request, APIError(500, f"internal error: {e!r}"))

    app.add_middleware(Counting, counts=served.counts)

    @app.get("/health")
    async def health():
        w = served.worker
        failure = w.died or getattr(w, "failure", None)  # tp.Leader: the ranks lost each other
        if failure is not None:
            body = {"status": "dead", "model": served.model, "error": failure}
            return JSONResponse(body, status_code=503)
        return {"status": "draining" if w.draining else "ok", "model": served.model}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_metrics(served), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        _auth(served, request)
        card = {"id": served.model, "object": "model", "created": 0, "owned_by": "loom"}
        card["checkpoint"] = served.checkpoint  # an extra field: which weights answer (path, step)
        card["context_length"] = served.context
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        _auth(served, request)
        return await _answer(served, request, _chat_job(served, await _body(served, request)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        _auth(served, request)
        return await _answer(served, request, _completion_job(served, await _body(served, request)))

    return app


class Counting:
    """Requests counted by route and status (/metrics), as a pure ASGI middleware: it passes the route the
    server's own receive channel, so a client that leaves is seen (`request.is_disconnected()`)."""

    def __init__(self, app, counts: Counter):
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]  # an exception before any response: the catch-all answers 500

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.counts[(scope["path"], status[0])] += 1


def _error(served: Served, request: "Request", e: APIError) -> "JSONResponse":  # noqa: F821
    from fastapi.responses import JSONResponse

    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _auth(served: Served, request: "Request") -> None:  # noqa: F821
    if served.api_key is None:
        return
    given = request.headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(token.encode(), served.api_key.encode()):
        what = "no API key given" if not token else "incorrect API key"
        raise APIError(401, f"{what}: pass it as 'Authorization: Bearer KEY'", code="invalid_api_key")


async def _body(served: Served, request: "Request") -> dict:  # noqa: F821
    """The JSON object of a request, whose model is the one served (404 otherwise)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply to read") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    protocol.refuse_unbuilt(body)
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("'model' is required (GET /v1/models lists it)", "model")
    if model != served.model:
        message = f"the model '{model}' does not exist; this server serves '{served.model}'"
        raise APIError(404, message, "model", "model_not_found")
    return body


def _encode(served: Served, text: str, param: str) -> list[int]:
    if len(text) > served.longest_token_chars * served.context:
        raise bad(
            f"the {param} has {len(text)} characters, more than the model's context of {served.context} tokens "
            "can hold",
            param,
            "context_length_exceeded",
        )
    try:
        return served.tokenizer.encode(text)
    except Exception as e:  # noqa: BLE001  (a character a char vocabulary lacks, ...: the text, not the server)
        raise bad(
            f"the {param} cannot be encoded by the model's tokenizer: {e}", param, "unencodable_text"
        ) from None


def _chat_job(served: Served, body: dict) -> Job:
    if served.template is None:
        raise bad(
            f"the model '{served.model}' is a base model: its tokenizer has no chat tokens, so it has no chat "
            "template; use /v1/completions (or fine-tune it on conversations: loom sft)",
            "messages",
            "chat_not_supported",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content}", "messages")
    tools = read_tools(body, served.template)
    messages = chat_messages(messages, tools)
    for m in messages:
        _encode(served, m["content"], "messages")  # the length bound before any encoding work
    try:
        ids = served.template.prompt(messages)
    except Exception as e:  # noqa: BLE001  (the template's own refusal: a role it has no token for, ...)
        raise bad(f"the messages cannot be rendered: {e}", "messages") from None
    top = protocol.number(body, "top_logprobs", 0, 0, protocol.MAX_TOP_LOGPROBS, integer=True)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad("'logprobs' must be true or false", "logprobs")
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    names = ("max_completion_tokens", "max_tokens")
    n_max = protocol.max_tokens(body, names, None, len(ids), served.context)
    fields = protocol.sampling(body, logprobs=logprobs, top=top)
    params = SamplingParams(max_tokens=n_max, stop_ids=frozenset(served.template.stop_ids), **fields)
    n, stream, usage = protocol.choices_and_stream(body)
    job = Job("chat", [ids], params, n, stream, usage, tools=tools)
    job.constrain = _response_format(served, body, params.stop_ids)
    if tools is not None and tools.choice != "auto":
        if job.constrain is not None and tools.choice != "none":
            raise bad("a forced tool call and a response_format cannot both hold", "tool_choice")
        if job.constrain is None:
            job.constrain = _constrained(
                served, tool_grammar(tools, served.grammars()), params.stop_ids, "tools"
            )
    return job


def _completion_job(served: Served, body: dict) -> Job:
    for name in ("tools", "tool_choice"):  # a chat request's fields: refused here, not ignored
        if body.get(name) not in (None, [], "none"):
            raise bad(
                f"'{name}' is not supported by /v1/completions; use /v1/chat/completions",
                name,
                "unsupported_field",
            )
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise bad("'prompt' must be a string or a non-empty list of strings", "prompt")
    ids = [_encode(served, p, "prompt") or [served.eot_id] for p in prompts]
    logprobs = protocol.number(body, "logprobs", None, 0, 5, integer=True)
    n_max = min(protocol.max_tokens(body, ("max_tokens",), 16, len(p), served.context) for p in ids)
    fields = protocol.sampling(body, logprobs=logprobs is not None, top=logprobs or 0)
    # a chat run's text ends at the end of a turn, and a chat token (a role's start or end) is never text
    stops = {served.eot_id, *(served.template.ids.values() if served.template is not None else ())}
    params = SamplingParams(max_tokens=n_max, stop_ids=frozenset(stops), **fields)
    n, stream, usage = protocol.choices_and_stream(body)
    if n * len(ids) > protocol.MAX_N:
        raise bad(f"n x prompts must be at most {protocol.MAX_N}", "n")
    job = Job("completion", ids, params, n, stream, usage)
    job.constrain = _response_format(served, body, params.stop_ids)
    return job


def _response_format(served: Served, body: dict, stop_ids: frozenset[int]):
    """The maker of each answer's grammar state for the request's response_format (None: free text)."""
    value = body.get("response_format")
    if value is None or value == {"type": "text"}:
        return None
    return _constrained(served, served.grammars().response_format(value), stop_ids, "response_format")


def _constrained(served: Served, grammar: str | None, stop_ids: frozenset[int], param: str):
    """A grammar checked against the served tokenizer (a 400 when it cannot be written), as a constraint maker."""
    if grammar is None:
        return None
    if hasattr(served.worker, "mirror"):  # tp.Leader: the other ranks' engines would sample without it
        raise bad(
            f"'{param}' is not supported by a tensor-parallel server (--nproc > 1)",
            param,
            "unsupported_field",
        )
    grammars = served.grammars()
    grammars.check_expressible(grammar, stop_ids, param)
    return lambda: grammars.constraint(grammar, stop_ids)


async def _answer(served: Served, request: "Request", job: Job):  # noqa: F821
    from fastapi.responses import JSONResponse, StreamingResponse

    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    for req in job.make_requests():
        # a stream wakes the event loop for every token; a whole answer only at its end (fewer switches
        # between the engine's thread and the loop's, which share the interpreter's lock)
        req.on_token = lambda r, stream=job.stream: (
            (stream or r.done) and loop.call_soon_threadsafe(ready.set)
        )
    try:
        for req in job.requests:
            served.worker.submit(req)
    except (QueueFull, Draining, Dead, ValueError) as e:
        for req in job.requests:
            served.worker.cancel(req)
        if isinstance(e, ValueError):
            raise bad(str(e)) from None
        if isinstance(e, Dead):
            raise APIError(503, str(e), code="engine_dead") from None
        status = 429 if isinstance(e, QueueFull) else 503
        raise APIError(
            status, f"{e}: try again shortly", code="queue_full" if status == 429 else None
        ) from None
    if job.stream:
        return StreamingResponse(_events(served, job, ready), media_type="text/event-stream")
    try:
        while not all(r.done for r in job.requests):
            try:
                await asyncio.wait_for(ready.wait(), 0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return JSONResponse({}, status_code=499)
                if served.worker.died is not None and not all(r.done for r in job.requests):
                    raise APIError(503, f"the engine has stopped ({served.worker.died})") from None
            ready.clear()
    finally:
        for req in job.requests:
            if not req.done:
                served.worker.cancel(req)
    _failed(job)
    return protocol.response(job, served.model, served.decode)


def _failed(job: Job) -> None:
    errors = [r.error for r in job.requests if r.error]
    if errors:
        raise APIError(500, f"generation failed: {errors[0]}")
    protocol.check_constraints(job)


async def _events(served: Served, job: Job, ready: asyncio.Event) -> AsyncIterator[str]:
    """The answer as server-sent events: the text each choice has that is sure not to be cut by a stop text,
    then each choice's end, then usage (when asked) and [DONE]."""
    sent = [0] * len(job.requests)
    toks = [0] * len(job.requests)
    states = [StreamState() for _ in job.requests]  # a chat with tools: the content and calls sent
    closed = [False] * len(job.requests)
    hold = max((len(s) for s in job.params.stop), default=1) - 1
    try:
        if job.kind == "chat":
            role = {"role": "assistant", "content": ""}
            first = [
                {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                for i in range(len(job.requests))
            ]
            yield _sse(protocol.chunk(job, served.model, first))
        while not all(closed):
            await ready.wait()
            ready.clear()
            _failed(job)
            for i, req in enumerate(job.requests):
                if closed[i]:
                    continue
                choice = (
                    _tool_delta(served, job, req, i, states[i])
                    if job.tools is not None
                    else _delta(served, job, req, i, sent, toks, hold)
                )
                if choice is not None:
                    closed[i] = choice["finish_reason"] is not None
                    yield _sse(protocol.chunk(job, served.model, [choice]))
        if job.include_usage:
            yield _sse(protocol.chunk(job, served.model, [], with_usage=True))
        yield "data: [DONE]\n\n"
    except APIError as e:
        yield _sse(e.body())
    except Exception as e:  # noqa: BLE001  (a bug: the stream ends with an error event, not a cut connection)
        log.error(f"loom serve: a streamed answer failed: {e!r}")
        yield _sse(APIError(500, f"internal error: {e!r}").body())
    finally:  # the client left (the task is cancelled here) or the answer is done: free the rows now
        for req in job.requests:
            if not req.done:
                served.worker.cancel(req)


def _delta(served: Served, job: Job, req, i: int, sent: list[int], toks: list[int], hold: int) -> dict | None:
    """Choice i's new text since the last event (None: nothing new yet)."""
    done = req.done
    n = len(req.tokens)
    text = served.decode(req.tokens[:n])
    if done:
        text = protocol.cut_at_stop(text, req.params.stop)
    else:
        text = text[: max(len(text) - hold, 0)] if hold else text
        if text.endswith("\ufffd"):  # a character still incomplete
            text = text[:-1]
    new = text[sent[i] :] if len(text) > sent[i] else ""
    if not new and not done:
        return None
    reason = None if not done else ("length" if req.finish_reason == "length" else "stop")
    lp = None
    if req.params.logprobs:
        keep = list(range(toks[i], n))
        lp = (protocol.chat_logprobs if job.kind == "chat" else protocol.completion_logprobs)(
            req, keep, served.decode
        )
    sent[i], toks[i] = max(sent[i], len(text)), n
    if job.kind == "chat":
        delta = {"content": new} if new else {}
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
    return {"index": i, "text": new, "logprobs": lp, "finish_reason": reason}


def _tool_delta(served: Served, job: Job, req, i: int, state: StreamState) -> dict | None:
    """Choice i's new content and whole tool calls since the last event (None: nothing new yet). Its
    logprobs are not streamed (null): the tokens of a call are not content."""
    done = req.done
    tokens = list(req.tokens)
    if done:  # cut before a stop text
        tokens = [tokens[k] for k in protocol.answer_tokens(req, served.decode)[1]]
    delta = stream_delta(job.tools, state, tokens, done, served.decode)
    if not delta and not done:
        return None
    reason = None
    if done:
        reason = "tool_calls" if state.calls else ("length" if req.finish_reason == "length" else "stop")
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _metrics(served: Served) -> str:
    """Prometheus' text format: requests by route and status, the queue, the running rows, tokens."""
    w, e = served.worker, served.worker.engine
    lines = [
        "# HELP loom_requests_total HTTP requests answered, by route and status.",
        "# TYPE loom_requests_total counter",
    ]
    for (route, status), n in sorted(served.counts.items()):
        lines.append(f'loom_requests_total{{route="{route}",status="{status}"}} {n}')
    gauges = [
        ("loom_queue_depth", "gauge", "Requests waiting for a row.", w.queue_depth()),
        ("loom_running_requests", "gauge", "Requests in the running batch.", len(e.running)),
        ("loom_generated_tokens_total", "counter", "Tokens generated.", e.generated),
        ("loom_prompt_tokens_total", "counter", "Prompt tokens prefilled.", e.prefilled),
        ("loom_generation_tokens_per_second", "gauge", "Generated tokens/s over 10 s.", w.tokens_per_s()),
        ("loom_kv_tokens_reserved", "gauge", "KV-cache tokens the running rows hold.", e.reserved),
        ("loom_uptime_seconds", "gauge", "Seconds since the server started.", time.monotonic() - w.started),
        ("loom_prefix_cache_hits_total", "counter", "Prompts that reused a cached prefix.", _hits(e)),
        ("loom_prefix_cache_tokens_total", "counter", "Prompt tokens reused from the cache.", _reused(e)),
        ("loom_spec_proposed_tokens_total", "counter", "Drafted tokens verified.", e.spec_proposed),
        ("loom_spec_accepted_tokens_total", "counter", "Drafted tokens accepted.", e.spec_accepted),
    ]
    for name, kind, doc, value in gauges:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"


def _hits(e) -> int:
    return 0 if e.prefix is None else e.prefix.hits


def _reused(e) -> int:
    return 0 if e.prefix is None else e.prefix.reused
