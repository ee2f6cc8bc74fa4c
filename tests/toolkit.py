"""The tool-calling tests' shared setup (test_serve_tools.py, test_serve_structured.py): a tiny char-level base
run whose vocabulary holds JSON's characters, conversations with tool calls in OpenAI's fine-tuning format
(tools, assistant tool_calls, tool results) prepared with its tokenizer, and `loom sft` on them."""

from __future__ import annotations

import json
import random

from sftkit import QUIET, make_char_base

from loom.cli import main

CITIES = ["paris", "rome", "oslo", "lima"]
WEATHER = {"paris": "sunny", "rome": "rainy", "oslo": "snowy", "lima": "cloudy"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
BLOCK = 512
MODEL = ["--model.n_layer=2", "--model.n_head=4", "--model.n_embd=64", f"--model.block_size={BLOCK}"]


def call(i: int, name: str, args: dict) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def conversation(rng: random.Random) -> dict:
    """One of: the weather of a city (a call, its result, the answer), of two cities (two calls at once), a sum
    (a call of add), or a greeting (no call)."""
    kind = rng.choice(["weather", "weather", "two", "add", "hello"])
    if kind == "hello":
        msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
        return {"messages": msgs, "tools": TOOLS}
    if kind == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        calls = [call(0, "add", {"a": a, "b": b})]
        user, results, final = f"add {a} {b}", [str(a + b)], str(a + b)
    else:
        cities = rng.sample(CITIES, 2 if kind == "two" else 1)
        calls = [call(i, "weather", {"city": c}) for i, c in enumerate(cities)]
        user = "weather in " + " and ".join(cities)
        results = [WEATHER[c] for c in cities]
        final = " and ".join(f"{c} is {WEATHER[c]}" for c in cities)
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": None, "tool_calls": calls}]
    msgs += [
        {"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results, strict=True)
    ]
    msgs.append({"role": "assistant", "content": final})
    return {"messages": msgs, "tools": TOOLS}


def make_tool_root(root, steps: int = 300) -> tuple:
    """(the SFT run that calls tools, its base run) under `root`."""
    rng = random.Random(0)
    records = [conversation(rng) for _ in range(400)]
    # the base's text holds every character the conversations write (a char vocabulary has only those)
    text = (
        "\n".join(json.dumps(r) for r in records[:50])
        + '\n0123456789 {}[]":,_-.\nabcdefghijklmnopqrstuvwxyz\n'
    )
    make_char_base(root, text, MODEL, "--train.steps=2", "--train.batch_size=2")
    with open(root / "tools.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    prep = ["data", "prepare", "--chat", "--input", str(root / "tools.jsonl"), "--out", str(root / "chat")]
    assert main([*prep, "--tokenizer", str(root / "runs" / "base"), "--block-size", str(BLOCK)]) == 0
    sft = [
        "sft",
        f"--data.path={root / 'chat'}",
        f"--model.init_from=run:{root / 'runs' / 'base'}",
        f"--run.dir={root / 'runs'}",
        "--run.name=tools",
        "--data.doc_mask=true",
        "--data.doc_positions=restart",
        *QUIET,
        f"--train.steps={steps}",
        "--train.batch_size=4",
        "--optim.lr=3e-3",
        "--optim.warmup_steps=10",
    ]
    assert main(sft) == 0
    return root / "runs" / "tools", root / "runs" / "base"
