"""What a conversation is, for loom's chat template (loom.data.chat) and a tokenizer's own (loom.data.hf_chat):
OpenAI-style messages, each {"role": "system" | "user" | "assistant" | "tool", "content": non-empty text}, a
system message only first, and (for training) at least one assistant turn; and reading them from records
({"messages": [...]} or {"prompt", "completion"}) of JSONL files (.jsonl, .jsonl.gz, .jsonl.zst, read as
loom.data.sources reads pretraining text) or Parquet files (those columns), every dropped record counted by
reason and place.

Tool calls, as OpenAI's fine-tuning format writes them: a record's "tools" ([{"type": "function", "function":
{"name", "description", "parameters"}}]) become a first message {"role": "tools", "content": the functions as
JSON} (the definitions the model reads); an assistant message may hold "tool_calls" ([{"type": "function",
"function": {"name", "arguments": JSON text or object}}], its content then may be empty or null); a "tool"
message holds a call's result as its content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from loom.data.sources import corrupt_errors, kind_of_file, open_jsonl, open_parquet
from loom.errors import LoomError

ROLES = ("system", "user", "assistant", "tool", "tools")  # "tools": the definitions, first (see above)
NAMED_PLACES = 5  # offending lines named per drop reason

Messages = list[dict]


def call_text(call: dict) -> str:
    """A tool call as the model writes it: {"name": ..., "arguments": {...}} as compact JSON (arguments given as
    JSON text are read first, so the model always sees one spelling; compact: what a forced call's grammar
    writes, loom.serve.tools)."""
    f = call.get("function", call)
    args = f.get("arguments", {})
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return json.dumps({"name": f["name"], "arguments": args}, ensure_ascii=False, separators=(",", ":"))


def message_texts(m: dict) -> list[str]:
    """The texts a message writes: its content, then each tool call's (call_text)."""
    return [m.get("content") or "", *map(call_text, m.get("tool_calls") or [])]


def _calls_problem(calls) -> str | None:
    if not isinstance(calls, list) or not calls:
        return "tool_calls is not a non-empty list"
    for c in calls:
        f = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            return "a tool call has no function name"
        try:
            call_text(c)
        except (ValueError, TypeError):
            return "a tool call's arguments are not JSON"
    return None


def message_problem(messages, need_assistant: bool = True) -> str | None:
    """Why a list of messages is not a conversation (a short reason, counted by prepare_chat), else None."""
    if not isinstance(messages, list) or not messages:
        return "messages is not a non-empty list"
    first = 1 if isinstance(messages[0], dict) and messages[0].get("role") == "tools" else 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return "a message is not an object"
        if m.get("role") not in ROLES:
            return "unknown role"
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or _calls_problem(calls)):
            return _calls_problem(calls) or "tool_calls in a message that is not the assistant's"
        content = m.get("content")
        if calls is not None and content is None:
            content = m["content"] = ""  # a call without text: OpenAI writes null
        if not isinstance(content, str):
            return "content is not a string"
        if not content and calls is None:
            return "empty content"
        if m["role"] == "system" and i > first:
            return "system message not first"
        if m["role"] == "tools" and i > 0:
            return "tools message not first"
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None


def check_messages(messages, need_assistant: bool = True) -> None:
    """Refuse messages that are not a conversation (message_problem), with the remedy."""
    problem = message_problem(messages, need_assistant)
    if problem:
        raise LoomError(
            f"not a conversation: {problem}",
            hint="messages are [{'role': 'system'|'user'|'assistant', 'content': 'non-empty text'}, ...], a "
            "system message only first" + (", and at least one assistant turn" if need_assistant else ""),
        )


# ------------------------------------------------------------------------------------ reading records


@dataclass
class Drops:
    """Records dropped, counted by reason, with the first few places (file:line) of each."""

    counts: dict[str, int] = field(default_factory=dict)
    places: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        named = self.places.setdefault(reason, [])
        if len(named) < NAMED_PLACES:
            named.append(where)

    def total(self) -> int:
        return sum(self.counts.values())

    def lines(self) -> list[str]:
        """One line per reason: how many, and where the first ones are."""
        out = []
        for reason, n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            more = f" and {n - len(self.places[reason])} more" if n > len(self.places[reason]) else ""
            out.append(f"{n} record(s): {reason} ({', '.join(self.places[reason])}{more})")
        return out


def record_messages(obj) -> tuple[Messages | None, str | None]:
    """(messages, None) for a record {"messages": [...]} or {"prompt": str, "completion": str}, else
    (None, the reason it is dropped)."""
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    if "messages" in obj:
        messages = obj["messages"]
    elif "prompt" in obj or "completion" in obj:
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            return None, "prompt or completion is not a string"
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    else:
        return None, "no messages (nor prompt and completion)"
    if obj.get("tools") and isinstance(messages, list):
        tools = tools_message(obj["tools"])
        if tools is None:
            return None, "tools is not a list of {type: function, function: {name, ...}}"
        messages = [tools, *messages]
    problem = message_problem(messages)
    return (None, problem) if problem else (messages, None)


def tools_message(tools) -> dict | None:
    """The first message of a conversation with tools: the functions' definitions as JSON (None: not a list of
    OpenAI tools)."""
    if not isinstance(tools, list):
        return None
    functions = [t.get("function") if isinstance(t, dict) else None for t in tools]
    if not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions):
        return None
    return {"role": "tools", "content": json.dumps(functions, ensure_ascii=False, separators=(",", ":"))}


def input_kind(path: Path) -> str:
    """How a --chat input is read, from its name: parquet, or JSONL plain (jsonl), gzip- (jsonl.gz) or
    zstandard-compressed (jsonl.zst), whatever precedes the .gz / .zst (chats.json.gz)."""
    kind = kind_of_file(path)
    if kind != "text":
        return kind
    name = path.name.lower()
    return "jsonl.gz" if name.endswith(".gz") else "jsonl.zst" if name.endswith(".zst") else "jsonl"


def _jsonl_records(path: Path, kind: str):
    """(file:line, record, None) per line of a JSONL file, or (file:line, None, why it is no record); blank
    lines are none. A .gz / .zst that is not compressed, or whose stream breaks, is an error naming it."""
    f = open_jsonl(path, kind)  # refuses a file named .gz / .zst that is not compressed
    corrupt = corrupt_errors(kind)
    n = 0
    with f:
        lines = iter(f)
        while True:
            try:
                raw = next(lines)
            except StopIteration:
                return
            except corrupt as e:
                raise LoomError(
                    f"'{path}' is corrupt after line {n} ({type(e).__name__}: {e})",
                    hint="replace the file, or keep its readable lines in a plain .jsonl",
                ) from None
            n += 1
            if not raw.strip():
                continue
            try:
                yield f"{path.name}:{n}", json.loads(raw.decode("utf-8-sig" if n == 1 else "utf-8")), None
            except UnicodeDecodeError:
                yield f"{path.name}:{n}", None, "not UTF-8"
            except ValueError:
                yield f"{path.name}:{n}", None, "not JSON"


PARQUET_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected")  # the last two: preference pairs


def _parquet_records(path: Path):
    """(file row N, record, None) per row of a Parquet file's messages (or prompt and completion) columns,
    read one row group at a time; rows are numbered from 0, as pandas and pyarrow do."""
    pf = open_parquet(path)
    names = pf.schema_arrow.names
    columns = [c for c in PARQUET_COLUMNS if c in names]
    if not columns:
        raise LoomError(
            f"'{path}' has no column messages (nor prompt and completion): its columns are {', '.join(names)}",
            hint="a row per conversation: a messages column of [{role, content}, ...], or prompt and completion",
        )
    row = 0
    for g in range(pf.num_row_groups):
        for rec in pf.read_row_group(g, columns=columns).to_pylist():
            yield f"{path.name} row {row}", rec, None
            row += 1


def read_conversations(inputs: list[Path], drops: Drops) -> list[tuple[str, Messages]]:
    """(place, messages) of every valid record of the inputs (JSONL, .jsonl.gz, .jsonl.zst or Parquet), in
    order; the others counted in `drops`."""
    found = []
    for where, obj, reason in read_records(inputs):
        messages, reason = (None, reason) if reason else record_messages(obj)
        if reason:
            drops.add(reason, where)
        else:
            found.append((where, messages))
    return found


def read_records(inputs: list[Path]):
    """(place, record, None) for every record of the inputs (JSONL, .jsonl.gz, .jsonl.zst or Parquet), in
    order, or (place, None, why it is no record)."""
    for path in inputs:
        kind = input_kind(path)
        yield from _parquet_records(path) if kind == "parquet" else _jsonl_records(path, kind)


def check_inputs(inputs: list[str | Path]) -> list[Path]:
    """The files of --input (JSONL or Parquet), each an existing, non-empty regular file (refused before any
    work)."""
    if not inputs:
        raise LoomError(
            "--chat needs --input FILE.jsonl", hint="loom data prepare --chat --input chats.jsonl"
        )
    paths = []
    for p in map(Path, inputs):
        if not p.exists():
            raise LoomError(f"--input '{p}' does not exist", hint="give the path of a JSONL file")
        if not p.is_file():
            raise LoomError(
                f"--input '{p}' is not a file: --chat reads JSONL (or Parquet) files",
                hint="name the .jsonl files themselves (one conversation per line)",
            )
        if p.stat().st_size == 0:
            raise LoomError(
                f"--input '{p}' is empty", hint="give a JSONL file with one conversation per line"
            )
        paths.append(p)
    return paths
