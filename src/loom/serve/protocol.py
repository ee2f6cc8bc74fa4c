"""The OpenAI API's requests read into engine requests, and the engine's results written as its responses.

Every field is checked here, before any work, and a bad one is an APIError: the status and the OpenAI-shaped
body ({"error": {"message", "type", "param", "code"}}) the server answers with.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from loom.engine import Request, SamplingParams, cut_at_stop

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop texts per request (the OpenAI API's bound)
MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch generator takes (a negative seed is seed mod 2**64)

# Fields of the OpenAI API (and of vLLM's) that would change the answer and are not built: refused (400, the
# field named) rather than ignored, unless they hold the value that changes nothing. (field, neutral test)
UNBUILT: tuple[tuple[str, object], ...] = (
    ("logit_bias", lambda v: v in (None, {})),
    ("presence_penalty", lambda v: v in (None, 0)),
    ("frequency_penalty", lambda v: v in (None, 0)),
    ("repetition_penalty", lambda v: v in (None, 1)),
    ("min_p", lambda v: v in (None, 0)),
    ("best_of", lambda v: v in (None, 1)),
    ("echo", lambda v: v in (None, False)),
    ("suffix", lambda v: v in (None, "")),
    ("functions", lambda v: v in (None, [])),
    ("function_call", lambda v: v in (None, "none")),
)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class Job:
    """One API request: its prompts (a completion may have several), each answered n times."""

    kind: str  # "chat" or "completion"
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    requests: list[Request] = field(default_factory=list)
    # each request's grammar state, made fresh per request (loom.serve.grammar.Grammars.constraint); None: free
    constrain: Callable[[], object] | None = None
    tools: object = None  # a chat request's tools (loom.serve.tools.Tools): its answers' calls parsed out

    def make_requests(self) -> list[Request]:
        """n requests per prompt, in the order of the choices; with a seed, choice i samples with seed + i
        (mod 2**64: the generator's own reading of a negative seed, so 2**64 - 1 with n = 2 is a seed too)."""
        p = self.params
        for k, ids in enumerate(self.prompts):
            for i in range(self.n):
                seed = None if p.seed is None else (p.seed + k * self.n + i) % 2**64
                params = SamplingParams(**{**p.__dict__, "seed": seed})
                req = Request(ids, params)
                req.constraint = self.constrain() if self.constrain is not None else None
                self.requests.append(req)
        return self.requests


def refuse_unbuilt(body: dict) -> None:
    """400 for a field that would change the answer and is not built (UNBUILT), naming it."""
    for name, neutral in UNBUILT:
        value = body.get(name)
        try:
            ok = bool(neutral(value))
        except TypeError:  # an unhashable value compared with a tuple's members: not neutral
            ok = False
        if not ok:
            raise bad(
                f"'{name}' is not supported by this server (got {value!r}); leave it out",
                name,
                "unsupported_field",
            )


def number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise bad(f"'{name}' must be {kind} in [{lo}, {hi}], got {value!r}", name)
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP:
        raise bad(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
    return tuple(s for s in stops if s)


def sampling(body: dict, *, logprobs: bool, top: int) -> dict:
    """The sampling fields every endpoint shares (max_tokens is checked against the prompt later)."""
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise bad("'top_p' must be in (0, 1]", "top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("'seed' must be an integer", "seed")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        raise bad(f"'seed' must be in [-2**63, 2**64 - 1], got {seed}", "seed")
    # top_k (vLLM's field; the engine samples with it): null, 0 or -1 is off
    top_k = number(body, "top_k", None, -1, 2**31 - 1, integer=True)
    return dict(
        temperature=float(temperature),
        top_k=top_k if top_k and top_k > 0 else None,
        top_p=None if top_p >= 1 else float(top_p),
        seed=seed,
        stop=_stops(body),
        logprobs=logprobs,
        top_logprobs=top,
    )


def max_tokens(body: dict, names: tuple[str, ...], default: int | None, prompt_len: int, context: int) -> int:
    """The tokens a request may generate: asked (> 0), or the default (None: what the context has left);
    prompt + answer must fit the context."""
    asked = next((body[n] for n in names if body.get(n) is not None), None)
    name = next((n for n in names if body.get(n) is not None), names[0])
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked <= 0):
        raise bad(f"'{name}' must be a positive integer, got {asked!r}", name)
    room = context - prompt_len
    if room <= 0:
        raise bad(
            f"the prompt has {prompt_len} tokens; the model's context is {context} tokens",
            "messages" if "max_completion_tokens" in names else "prompt",
            "context_length_exceeded",
        )
    n = asked if asked is not None else min(default or room, room)
    if prompt_len + n > context:
        raise bad(
            f"{prompt_len} prompt tokens + {name}={n} exceed the model's context of {context} tokens",
            name,
            "context_length_exceeded",
        )
    return n


def choices_and_stream(body: dict) -> tuple[int, bool, bool]:
    n = number(body, "n", 1, 1, MAX_N, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    return n, stream, bool(options.get("include_usage", False))


def check_constraints(job: Job) -> None:
    """A 400 for an answer whose grammar ran into a dead end: the tokenizer could not write what it asks."""
    dead = next(
        (r.constraint.dead for r in job.requests if r.constraint is not None and r.constraint.dead), None
    )
    if dead:
        raise bad(
            f"the model's tokenizer cannot express the requested format: {dead}",
            "response_format",
            "grammar_not_expressible",
        )


def usage(job: Job) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(r.tokens) for r in job.requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def answer_tokens(req: Request, decode) -> tuple[str, list[int]]:
    """The answer's text, cut before its first stop text, and the tokens whose text it holds."""
    text = cut_at_stop(decode(req.tokens), req.params.stop)
    if len(text) == len(decode(req.tokens)):
        return text, list(range(len(req.tokens)))
    keep, size = [], 0
    for i, t in enumerate(req.tokens):
        size += len(decode([t]))
        if size > len(text):
            break
        keep.append(i)
    return text, keep


def chat_logprobs(req: Request, keep: list[int], decode) -> dict | None:
    if not req.params.logprobs:
        return None

    def entry(token: int, lp: float) -> dict:
        piece = decode([token])
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

    content = []
    for i in keep:
        item = entry(req.tokens[i], req.logprobs[i])
        item["top_logprobs"] = [entry(t, lp) for t, lp in req.top[i]] if req.top else []
        content.append(item)
    return {"content": content}


def completion_logprobs(req: Request, keep: list[int], decode) -> dict | None:
    if not req.params.logprobs:
        return None
    pieces = [decode([req.tokens[i]]) for i in keep]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    tops = [{decode([t]): lp for t, lp in req.top[i]} for i in keep] if req.top else [None] * len(keep)
    return {
        "tokens": pieces,
        "token_logprobs": [req.logprobs[i] for i in keep],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def response(job: Job, model: str, decode) -> dict:
    """The whole (not streamed) answer to a job."""
    choices = []
    for i, req in enumerate(job.requests):
        text, keep = answer_tokens(req, decode)
        reason = "length" if req.finish_reason == "length" else "stop"
        if job.kind == "chat":
            message = {"role": "assistant", "content": text}
            if job.tools is not None:  # the answer's tool calls parsed out of it (loom.serve.tools)
                message, called = job.tools.answer([req.tokens[k] for k in keep], decode, text)
                reason = "tool_calls" if called else reason
            lp = chat_logprobs(req, keep, decode)
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            lp = completion_logprobs(req, keep, decode)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
    kind = "chat.completion" if job.kind == "chat" else "text_completion"
    prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
    return {
        "id": prefix + job.id,
        "object": kind,
        "created": job.created,
        "model": model,
        "choices": choices,
        "usage": usage(job),
    }


def chunk(job: Job, model: str, choices: list[dict], with_usage: bool = False) -> dict:
    """One server-sent event of a streamed answer."""
    kind = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
    out = {"id": prefix + job.id, "object": kind, "created": job.created, "model": model, "choices": choices}
    if with_usage:
        out["usage"] = usage(job)
    return out
