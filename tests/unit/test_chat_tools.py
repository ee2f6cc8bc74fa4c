"""Tool calls in chat data (loom.data.messages, loom.data.chat): a record in OpenAI's fine-tuning format (tools,
assistant tool_calls with null content, tool results) read into messages and rendered with loom's template,
token by token against the layout its docstring draws, the mask on the assistant's calls and answer only; the
tool tokens added only to data that has tool calls; a template without them refuses tools."""

import json

import pytest

from loom.data.chat import (
    ASSISTANT_END,
    ASSISTANT_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_END,
    TOOL_START,
    TOOL_TOKENS,
    TOOLS_END,
    TOOLS_START,
    USER_END,
    USER_START,
    ChatTemplate,
    add_chat_tokens,
)
from loom.data.messages import message_problem, record_messages
from loom.data.tokenizers import CharTokenizer
from loom.errors import LoomError

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
RECORD = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c0", "content": "3"},
        {"role": "assistant", "content": "3"},
    ],
}
CHARS = '{}[]":,0123456789 abcdefghijklmnopqrstuvwxyz_'


def template(tools: bool = True) -> ChatTemplate:
    return ChatTemplate(add_chat_tokens(CharTokenizer.train([CHARS]), tools=tools))


def test_a_fine_tuning_record_with_tools_reads_into_messages():
    messages, reason = record_messages(json.loads(json.dumps(RECORD)))
    assert reason is None
    assert messages[0] == {"role": "tools", "content": '[{"name":"add","parameters":{"type":"object"}}]'}
    assert messages[2]["content"] == "" and messages[2]["tool_calls"] == [CALL]
    assert (
        message_problem([{"role": "user", "content": "x"}, {"role": "tools", "content": "[]"}])
        == "tools message not first"
    )
    bad_call = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
    ]
    assert message_problem(bad_call) == "a tool call has no function name"


def test_render_writes_the_tool_roles_and_trains_on_the_calls():
    t = template()
    messages, _ = record_messages(json.loads(json.dumps(RECORD)))
    ids, mask = t.render(messages)
    tok, tid = t.tok, t.ids
    call = '{"name":"add","arguments":{"a":1,"b":2}}'
    want = [tok.eot_id, tid[TOOLS_START], *tok.encode(messages[0]["content"]), tid[TOOLS_END]]
    want += [tid[USER_START], *tok.encode("add 1 2"), tid[USER_END]]
    want += [
        tid[ASSISTANT_START],
        tid[TOOL_CALL_START],
        *tok.encode(call),
        tid[TOOL_CALL_END],
        tid[ASSISTANT_END],
    ]
    want += [tid[TOOL_START], *tok.encode("3"), tid[TOOL_END]]
    want += [tid[ASSISTANT_START], *tok.encode("3"), tid[ASSISTANT_END]]
    assert ids == want
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert trained == [
        tid[TOOL_CALL_START],
        *tok.encode(call),
        tid[TOOL_CALL_END],
        tid[ASSISTANT_END],
        *tok.encode("3"),
        tid[ASSISTANT_END],
    ]
    # the prompt of the answer after the result is the render up to its <|assistant_start|>
    assert t.prompt(messages[:-1]) == ids[: len(ids) - 2]


def test_tool_tokens_only_for_data_with_tools_and_refused_without():
    plain = template(tools=False)
    assert not plain.tools and not any(t in plain.ids for t in TOOL_TOKENS)
    assert template().tok.vocab_size == plain.tok.vocab_size + len(TOOL_TOKENS)
    messages, _ = record_messages(json.loads(json.dumps(RECORD)))
    with pytest.raises(LoomError, match="no tool roles"):
        plain.prompt(messages[:2])
    assert plain.prompt([{"role": "user", "content": "hi"}])[-1] == plain.ids[ASSISTANT_START]


HERMES_JINJA = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments.a }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_imported_template_writes_the_tools_its_own_way_and_its_calls_parse(tmp_path):
    """--chat-template tokenizer: the tools go to the template's `tools`, a call's arguments as an object; the
    server reads Hermes/Qwen's <tool_call> answers and a bare JSON call back (loom.serve.tools)."""
    pytest.importorskip("transformers")
    from test_chat_data import hf_tokenizer_folder

    from loom.data.hf_chat import HFChatTemplate
    from loom.serve.tools import Tools, parse

    folder = hf_tokenizer_folder(
        tmp_path / "hermes", ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], HERMES_JINJA
    )
    messages, _ = record_messages(json.loads(json.dumps(RECORD)))
    t = HFChatTemplate.from_folder(folder, [("x", messages)])
    text = t.inner.decode(t.prompt(messages[:-1]), skip_special_tokens=False)
    assert (
        "tools: add<|im_end|>" in text
        and "<tool_call>add 1</tool_call>" in text
        and text.endswith("assistant\n")
    )
    tools = Tools([{"name": "add"}], "auto")
    hermes = parse(tools, [], None, 'ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert hermes.content == "ok" and json.loads(hermes.calls[0]["function"]["arguments"]) == {"a": 1}
    bare = parse(tools, [], None, '{"name": "add", "parameters": {"a": 2}}')
    assert bare.content == "" and bare.calls[0]["function"]["name"] == "add"
    assert parse(tools, [], None, '{"name": "sub", "arguments": {}}').calls == []  # no such tool: text
