"""Structured output in `loom serve` (response_format: a JSON schema, any JSON object, loom's regex extension)
against the official `openai` client: 100 answers sampled at temperature 1 from a tiny model, each parsed and
validated by `jsonschema` (an independent validator, not the grammar library); JSON objects cut by max_tokens
checked as prefixes a matcher accepts; and each bad input an OpenAI-shaped 400 (an invalid schema, a keyword the
grammar library does not compile, named; a run whose tokenizer cannot write the grammar).

The 100 answers come from a `loom serve` process (the command); the others from the same app in a thread."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch

from loom.env import detect_env
from loom.runs import open_run
from loom.serve import ServeOptions, served_for, serving_in_thread

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["paris", "rome", "oslo", "lima"]},
        "name": {"type": "string", "minLength": 1, "maxLength": 8, "pattern": "^[a-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["city", "name", "age", "ok", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@contextlib.contextmanager
def serve_process(run_dir):
    """`loom serve RUN` as a process on a free port: the base URL of its API."""
    cmd = [sys.executable, "-m", "loom", "serve", str(run_dir), "--port", "0", "--device", "cpu"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = next(
            ("http://" + line.split("http://")[1].split()[0] for line in proc.stdout if "http://" in line),
            None,
        )
        assert url, "loom serve printed no address"
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def serving(run_dir):
    with open_run(run_dir, torch.device("cpu"), detect_env()) as run:
        served = served_for(run, run_dir, ServeOptions(max_seqs=16))
        with serving_in_thread(served) as port:
            yield openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60
            )


@pytest.fixture(scope="module")
def client(tool_run):
    with serving(tool_run[0]) as c:
        yield c


def test_100_answers_at_temperature_1_each_valid_against_the_schema(tool_run):
    with serve_process(tool_run[0]) as url:
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)

        def ask(seed: int) -> list:
            r = c.chat.completions.create(
                model="tools",
                messages=[{"role": "user", "content": "hello"}],
                response_format=FORMAT,
                temperature=1,
                max_tokens=200,
                n=10,
                seed=seed,
            )
            return r.choices

        with ThreadPoolExecutor(5) as pool:  # 5 requests of 10 answers at once (the queue holds 64 rows)
            choices = [ch for chs in pool.map(ask, range(0, 100, 10)) for ch in chs]
    assert len(choices) == 100
    answers = set()
    for ch in choices:
        assert ch.finish_reason == "stop", ch.message.content
        value = json.loads(ch.message.content)
        jsonschema.validate(value, SCHEMA)
        answers.add(ch.message.content)
    assert len(answers) > 50  # sampled (temperature 1), not a few answers many times


def test_json_object_answers_are_json_objects_or_their_prefixes(client, tool_run):
    from loom.data.loader import read_meta
    from loom.data.tokenizers import load_tokenizer
    from loom.serve.grammar import Grammars

    r = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "hello"}],
        response_format={"type": "json_object"},
        temperature=1,
        max_tokens=60,
        n=8,
        seed=1,
    )
    tok_dir = tool_run[0] / "tokenizer"
    tok = load_tokenizer(tok_dir, read_meta(tok_dir))
    grammars = Grammars(tok, tok.vocab_size)
    grammar = grammars.response_format({"type": "json_object"})
    for ch in r.choices:
        text = ch.message.content
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: every token of it is one the grammar allowed
            assert ch.finish_reason == "length" and text.startswith("{")
            matcher = grammars.constraint(grammar, [tok.eot_id]).matcher
            assert matcher.consume_tokens(tok.encode(text)), matcher.get_error()


def test_regex_answers_match_it(client):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    r = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "hello"}],
        response_format={"type": "regex", "regex": pattern},
        temperature=1,
        max_tokens=20,
        n=8,
        seed=2,
    )
    for ch in r.choices:
        assert ch.finish_reason == "stop" and re.fullmatch(pattern, ch.message.content), ch.message.content


def test_greedy_free_answer_is_the_same_beside_constrained_rows(client):
    """A row without a grammar samples what it sampled alone while constrained rows share its batch."""
    ask = dict(model="tools", messages=[{"role": "user", "content": "weather in rome"}], max_tokens=40)
    alone = client.chat.completions.create(**ask, temperature=0).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:
        busy = [
            pool.submit(client.chat.completions.create, **ask, temperature=1, n=8, response_format=FORMAT)
            for _ in range(3)
        ]
        free = client.chat.completions.create(**ask, temperature=0).choices[0].message.content
        assert all(len(f.result().choices) == 8 for f in busy)
    assert free == alone


def _error(e: openai.APIStatusError) -> dict:
    return e.response.json()["error"]


@pytest.mark.parametrize(
    "response_format, code, named",
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
            "invalid_schema",
            "objekt",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}},
            },
            "invalid_schema",
            "properties",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
            "unsupported_schema_feature",
            "uniqueItems",
        ),
        ({"type": "regex", "regex": "(unclosed"}, "invalid_grammar", "unclosed"),
        ({"type": "yaml"}, None, "json_schema"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(client, response_format, code, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tools", messages=[{"role": "user", "content": "hi"}], response_format=response_format
        )
    err = _error(e.value)
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == "response_format" and err["code"] == code and named in err["message"]


def test_a_tokenizer_that_cannot_write_the_grammar_is_a_400(sft):
    """The chat run of tests/sftkit.py: a character vocabulary of lowercase words, without '{'."""
    from sftkit import _sft_args

    from loom.cli import main

    assert main(_sft_args(sft, "chat", "--train.steps=2")) == 0
    with serving(sft / "runs" / "chat") as c:
        # no token starts the answer ('{', a digit), or none goes on after the first ('a', then a digit)
        for fmt in (
            {"type": "json_object"},
            {"type": "regex", "regex": "[0-9]+"},
            {"type": "regex", "regex": "a[0-9]"},
        ):
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "again"}], response_format=fmt
                )
            err = _error(e.value)
            assert err["code"] == "grammar_not_expressible" and "cannot express" in err["message"]
        # a format it can write still answers
        r = c.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "again"}],
            response_format={"type": "regex", "regex": "(apple|river) (stone|cloud)"},
            temperature=1,
            max_tokens=20,
        )
        assert re.fullmatch("(apple|river) (stone|cloud)", r.choices[0].message.content)
