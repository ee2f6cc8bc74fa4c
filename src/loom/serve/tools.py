"""Tool calls in /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, assistant messages with
`tool_calls` and `tool` messages, read into the run's chat template, and the model's answer parsed back into
`tool_calls` (whole, or streamed as deltas).

loom's chat template (loom.data.chat, a tokenizer with the tool tokens) writes the functions between
<|tools_start|> and <|tools_end|>, each call the model makes between <|tool_call_start|> and <|tool_call_end|>
as compact JSON {"name": ..., "arguments": {...}}, and each result between <|tool_start|> and <|tool_end|>. Its
answers are split at those tokens' ids (text between calls is the message's content). tool_choice "required" or
a named function is forced by a grammar (loom.serve.grammar): one call or more (one only with
parallel_tool_calls false) of the allowed functions, their arguments valid against the function's JSON
schema; "none" by a grammar of plain text (no special token, so no call); "auto" leaves the model free.

An imported template (--chat-template tokenizer: Llama 3, Qwen) gets the tools as transformers' `tools` and
writes them in its own format; its answers are parsed for the formats those families use (Hermes/Qwen's
<tool_call>{...}</tool_call>, or an answer that is one JSON object {"name", "arguments" | "parameters"}).
Forcing a call there is not built (a 400): the grammar would have to be each family's own.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from loom.serve.protocol import bad

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the OpenAI API's function names
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclass
class Tools:
    """A chat request's tools and how it may call them."""

    functions: list[dict]  # [{"name", "description"?, "parameters"?}]
    choice: str  # "auto", "none", "required", or "function" (then `name`)
    name: str | None = None
    parallel: bool = True
    ids: tuple[int, int] | None = (
        None  # loom's template: (<|tool_call_start|>, <|tool_call_end|>); None: imported
    )

    def answer(self, tokens: list[int], decode, text: str) -> tuple[dict, bool]:
        """(the assistant message of a whole answer, whether it called a tool)."""
        parsed = parse(self, tokens, decode, text)
        message = {"role": "assistant", "content": parsed.content or (None if parsed.calls else "")}
        if parsed.calls:
            message["tool_calls"] = parsed.calls
        return message, bool(parsed.calls)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def message(self) -> dict:
        """The conversation's first message: the functions (loom.data.messages' "tools" role)."""
        from loom.data.messages import tools_message

        return tools_message([{"type": "function", "function": f} for f in self.functions])


def read_tools(body: dict, template) -> Tools | None:
    """The request's tools and tool_choice (None: no tools), each checked (400 naming the field)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of {type: function, function: {name, ...}}", "tools")
    functions = [_function(t) for t in tools]
    if len({f["name"] for f in functions}) < len(functions):
        raise bad("'tools' names a function twice", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    from loom.data.chat import ChatTemplate

    ids = None
    if isinstance(template, ChatTemplate):  # loom's template (else an imported one: its own tool format)
        if not template.tools:
            raise bad(
                "this model's chat template has no tool roles (its tokenizer has no tool tokens): fine-tune it "
                "on conversations with tool calls (loom data prepare --chat, loom sft)",
                "tools",
                "tools_not_supported",
            )
        ids = (template.ids["<|tool_call_start|>"], template.ids["<|tool_call_end|>"])
    out = Tools(functions, "auto", parallel=parallel, ids=ids)
    _choice(out, "auto" if choice is None else choice)
    if out.choice in ("required", "function") and ids is None:
        raise bad(
            "forcing a tool call (tool_choice required or a named function) is built for loom's chat template "
            "only; this run's imported template writes calls in its own format: use tool_choice auto",
            "tool_choice",
            "unsupported_field",
        )
    return out


def _function(tool) -> dict:
    f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
        raise bad(
            "each of 'tools' must be {type: function, function: {name (letters, digits, _ and -, at most 64), "
            "description, parameters}}",
            "tools",
        )
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"the parameters of function '{f['name']}' must be a JSON schema (an object)", "tools")
    return {k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None}


def _choice(tools: Tools, choice) -> None:
    if choice in ("auto", "none", "required"):
        tools.choice = choice
        return
    f = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad(
            "'tool_choice' must be auto, none, required or {type: function, function: {name}}", "tool_choice"
        )
    if f["name"] not in tools.names:
        raise bad(
            f"'tool_choice' names the function '{f['name']}', which is not in 'tools' "
            f"({', '.join(sorted(tools.names))})",
            "tool_choice",
            "unknown_function",
        )
    tools.choice, tools.name = "function", f["name"]


# ------------------------------------------------------------------------------------------- messages
def chat_messages(messages: list, tools: Tools | None) -> list[dict]:
    """The request's messages as loom.data.messages reads them (the tools first), each checked (400)."""
    out = [tools.message()] if tools is not None else []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "user",
            "assistant",
            "tool",
            "developer",
        ):
            raise bad(
                "each message needs a 'role' (system, user, assistant or tool) and its content", "messages"
            )
        content, calls = m.get("content"), m.get("tool_calls")
        if isinstance(content, list):  # content parts: their text, joined
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        if not isinstance(content, str) and not (calls and content is None):
            raise bad("each message needs a string 'content' (null only beside 'tool_calls')", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content or ""}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def grammar(tools: Tools, grammars) -> str | None:
    """The grammar that forces the choice (loom's template): a Lark grammar of calls for required or a named
    function, plain text for none; None for auto."""
    if tools.choice == "auto":
        return None
    if tools.choice == "none":  # text only: a special token (<|tool_call_start|>) is never text
        return grammars.free_text()
    allowed = [f for f in tools.functions if tools.choice == "required" or f["name"] == tools.name]
    schema = {
        "anyOf": [_call_schema(f) for f in allowed],
        "x-guidance": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
    }
    start, end = tools.ids
    lark = f"start: call{'+' if tools.parallel else ''}\ncall: <[{start}]> body <[{end}]>\nbody: %json {json.dumps(schema)}\n"
    return grammars.lark(lark, "tools")


def _call_schema(f: dict) -> dict:
    params = f.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# ------------------------------------------------------------------------------------------- answers
@dataclass
class Parsed:
    content: str
    calls: list[dict] = field(default_factory=list)  # the OpenAI API's tool_calls


def _call(obj, names: set[str]) -> dict | None:
    """An OpenAI tool call from a parsed {"name", "arguments" | "parameters"} (None: not a call of a tool)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    fn = {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": fn}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def segments(tools: Tools, tokens: list[int]) -> tuple[list[list[int]], list[list[int]], bool]:
    """loom's template: (the runs of text tokens, the calls' tokens, whether a call is still open)."""
    start, end = tools.ids
    texts, calls, cur, inside = [[]], [], [], False
    for t in tokens:
        if t == start and not inside:
            inside, cur = True, []
        elif t == end and inside:
            inside = False
            calls.append(cur)
            texts.append([])
        elif inside:
            cur.append(t)
        elif t not in (start, end):
            texts[-1].append(t)
    return texts, calls, inside


def parse(tools: Tools, tokens: list[int], decode, text: str | None = None) -> Parsed:
    """The answer's content and tool calls. A call that does not parse (or names no tool) stays in the
    content as written."""
    if tools.ids is None:
        return _parse_imported(tools, text if text is not None else decode(tokens))
    texts, calls, _ = segments(tools, tokens)
    content, out = "", []
    for i, run in enumerate(texts):
        content += decode(run)
        if i < len(calls):
            raw = decode(calls[i])
            call = _call(_loads(raw), tools.names)
            if call is None:
                content += decode([tools.ids[0]]) + raw + decode([tools.ids[1]])
            else:
                out.append(call)
    return Parsed(content, out)


def _parse_imported(tools: Tools, text: str) -> Parsed:
    calls = [c for c in (_call(_loads(m), tools.names) for m in HERMES.findall(text)) if c is not None]
    if calls:
        return Parsed(HERMES.sub("", text).strip(), calls)
    whole = _call(_loads(text.strip()), tools.names)
    return Parsed("", [whole]) if whole is not None else Parsed(text)


@dataclass
class StreamState:
    """What a streamed choice has sent: content characters and tool calls."""

    sent: int = 0
    calls: int = 0


def stream_delta(tools: Tools, state: StreamState, tokens: list[int], done: bool, decode) -> dict:
    """The delta of a streamed choice since the last one: new content (the text sure to stay, as parse
    reads it) and each tool call once it is whole ({"index", "id", "type", "function": {name, arguments}})."""
    if tools.ids is None and not done:  # an imported template's calls are read from the whole answer
        return {}
    if tools.ids is not None and not done and segments(tools, tokens)[2]:  # a call is open: up to its start
        tokens = tokens[: len(tokens) - tokens[::-1].index(tools.ids[0]) - 1]
    parsed = parse(tools, tokens, decode)
    content = parsed.content
    if not done and content.endswith("\ufffd"):  # a character still incomplete
        content = content[:-1]
    delta: dict = {}
    if len(content) > state.sent:
        delta["content"] = content[state.sent :]
        state.sent = len(content)
    new = parsed.calls[state.calls :]
    if new:
        delta["tool_calls"] = [{"index": state.calls + k, **c} for k, c in enumerate(new)]
        state.calls += len(new)
    return delta
