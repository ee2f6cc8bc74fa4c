"""Tool calls in `loom serve` against the official `openai` client: a tiny model `loom sft` taught on 400
synthetic tool-call conversations (tests/toolkit.py) goes through the client's tool-calling loop (the calls,
the client runs them, their results as tool messages, the answer); forced choices (a named function, required,
one call only) always give calls valid against the function's schema; auto lets the model call on its own;
none keeps it from calling; streamed calls arrive as deltas equal to the whole answer's; bad input is a 400.

The model is too weak to be right about every argument: the tests check what the server guarantees (valid
calls where forced, parsing where free), and that the taught model does call in auto mode."""

from __future__ import annotations

import contextlib
import json

import jsonschema
import openai
import pytest
import torch
from toolkit import TOOLS, WEATHER

from loom.env import detect_env
from loom.runs import open_run
from loom.serve import ServeOptions, served_for, serving_in_thread

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@contextlib.contextmanager
def serving(run_dir, name: str):
    with open_run(run_dir, torch.device("cpu"), detect_env()) as run:
        served = served_for(run, run_dir, ServeOptions(max_seqs=8, model_name=name))
        with serving_in_thread(served) as port:
            yield openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
            )


@pytest.fixture(scope="module")
def client(tool_run):
    with serving(tool_run[0], "tools") as c:
        yield c


def ask(client, messages, **kw):
    return client.chat.completions.create(
        model="tools", messages=messages, tools=TOOLS, max_tokens=80, temperature=0, **kw
    )


def run_tool(call) -> str:
    """What the client's side of the loop runs for a call."""
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return WEATHER[args["city"]] if call.function.name == "weather" else str(args["a"] + args["b"])


def test_the_client_tool_loop_with_a_named_function(client):
    messages = [{"role": "user", "content": "weather in rome"}]
    r = ask(client, messages, tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert all(
        c.function.name == "weather" and c.id and c.type == "function" for c in choice.message.tool_calls
    )
    messages.append(choice.message.model_dump(exclude_none=True))
    for call in choice.message.tool_calls:  # each validated against the function's schema
        messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    final = ask(client, messages, tool_choice="none").choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.tool_calls is None
    assert isinstance(final.message.content, str) and final.message.content


def test_required_calls_are_valid_and_one_only_without_parallel_calls(client):
    messages = [{"role": "user", "content": "weather in oslo and lima"}]
    for prompt in ("weather in oslo and lima", "add 3 5", "hello"):
        messages = [{"role": "user", "content": prompt}]
        calls = ask(client, messages, tool_choice="required").choices[0].message.tool_calls
        assert calls and all(run_tool(c) for c in calls)
        one = ask(client, messages, tool_choice="required", parallel_tool_calls=False).choices[0]
        assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
        run_tool(one.message.tool_calls[0])


def test_auto_the_taught_model_calls_on_its_own_and_answers_a_greeting(client):
    r = ask(client, [{"role": "user", "content": "weather in rome"}]).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.tool_calls[0].function.name == "weather"
    assert "city" in json.loads(r.message.tool_calls[0].function.arguments)
    hi = ask(client, [{"role": "user", "content": "hello"}]).choices[0]
    assert hi.finish_reason == "stop" and hi.message.tool_calls is None and hi.message.content == "hi"


def test_none_never_calls(client):
    r = ask(client, [{"role": "user", "content": "weather in rome"}], tool_choice="none").choices[0]
    assert r.message.tool_calls is None and "<|tool_call_start|>" not in (r.message.content or "")


def test_streamed_tool_calls_are_the_whole_answers_calls(client):
    messages = [{"role": "user", "content": "weather in oslo and lima"}]
    whole = ask(client, messages, tool_choice="required").choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    reasons = []
    for event in ask(client, messages, tool_choice="required", stream=True):
        for ch in event.choices:
            reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    assert reasons[-1] == "tool_calls"
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert got == [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def _error(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


def test_tool_choice_naming_an_unknown_function_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        ask(
            client,
            [{"role": "user", "content": "hi"}],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    err = _error(e.value)
    assert e.value.status_code == 400 and err["param"] == "tool_choice" and err["code"] == "unknown_function"
    assert "nope" in err["message"] and "weather" in err["message"]


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, "tools"),
        (None, "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
    ],
)
def test_bad_tools_are_400s(client, tools, choice, param):
    kw = {"tools": tools} if tools is not None else {}
    if choice is not None:
        kw["tool_choice"] = choice
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tools", messages=[{"role": "user", "content": "hi"}], **kw)
    assert _error(e.value)["param"] == param


def test_a_run_without_tool_roles_refuses_tools(sft):
    from sftkit import _sft_args

    from loom.cli import main

    assert main(_sft_args(sft, "chat", "--train.steps=2")) == 0
    with serving(sft / "runs" / "chat", "chat") as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": "again"}], tools=TOOLS
            )
        assert _error(e.value)["code"] == "tools_not_supported"
