"""`loom chat`'s loop (loom.chat.repl): Ctrl-C during an answer, /commands.

Compared against: the conversation the session holds and the prompts the model is given, with the model's
token stream replaced by a scripted one (loom.generate.iter_tokens): the same tokens a model would yield,
Ctrl-C raised as KeyboardInterrupt between two of them, as Python delivers SIGINT in the stream loop.
"""

from __future__ import annotations

import io
import types

import pytest
import torch

from loom.chat import ChatSession, repl
from loom.data.chat import ChatTemplate, add_chat_tokens
from loom.data.tokenizers import CharTokenizer


class Stream:
    """iter_tokens' stand-in: answer i is scripts[i] = (text, Ctrl-C after this many tokens or None)."""

    def __init__(self, template: ChatTemplate, scripts: list[tuple[str, int | None]]):
        self.template, self.scripts, self.prompts = template, list(scripts), []

    def __call__(self, model, idx, max_new_tokens, **kwargs):
        self.prompts.append(idx[0].tolist())
        text, stop_after = self.scripts.pop(0)
        for i, token in enumerate(self.template.tok.encode(text)):
            if i == stop_after:
                raise KeyboardInterrupt
            yield torch.tensor([[token]])
        yield torch.tensor([[self.template.end_id]])


@pytest.fixture
def chat(monkeypatch):
    template = ChatTemplate(add_chat_tokens(CharTokenizer(list(" /?abcdefghijklmnopqrstuvwxyz"))))
    model = types.SimpleNamespace(cfg=types.SimpleNamespace(block_size=256))
    session = ChatSession(model, template, template.tok, torch.device("cpu"))

    def run(lines: list[str], scripts: list[tuple[str, int | None]]) -> tuple[str, Stream]:
        stream = Stream(template, scripts)
        monkeypatch.setattr("loom.generate.iter_tokens", stream)
        out, given = io.StringIO(), iter(lines)
        try:
            repl(session, read=lambda _: next(given), write=out)
        except KeyboardInterrupt:  # raised by the stream: it must not leave the loop (nor stop pytest)
            pytest.fail(f"Ctrl-C during an answer ended the session:\n{out.getvalue()}")
        return out.getvalue(), stream

    return types.SimpleNamespace(session=session, template=template, run=run)


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(chat):
    """Ctrl-C while an answer streams ended the session and its conversation: now it stops that answer, a
    marker is printed, and the next line is the next turn of the same conversation."""
    text, stream = chat.run(
        ["hi", "say more", "and", "bye", "/quit"],
        [("hello there", 5), ("x", 0), ("yes", None), ("ok", None)],
    )
    assert "assistant> hello [stopped]\nassistant>  [stopped]\nassistant> yes\nassistant> ok\n" in text
    assert chat.session.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},  # what was shown of the stopped answer
        # "say more", stopped before a token was shown, was taken back: no empty assistant turn
        {"role": "user", "content": "and"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok"},
    ]
    # the model was given the conversation with the stopped answer in it
    assert stream.prompts[2] == chat.template.prompt(chat.session.messages[:3])


def test_help_and_unknown_commands_are_not_sent_to_the_model(chat):
    text, stream = chat.run(
        ["/help", "/x", "/reset now", "/etc/hosts?", "//help", "/quit"], [("a", None), ("b", None)]
    )
    assert text.count("commands: /help lists these commands, /reset starts a new conversation, /quit") == 2
    assert "unknown command /x (nothing was sent); commands: /help" in text
    assert "(new conversation)" in text
    # text that only starts with a slash is a turn; // sends a line that starts with one
    assert [m["content"] for m in chat.session.messages if m["role"] == "user"] == ["/etc/hosts?", "/help"]
    assert len(stream.prompts) == 2


def test_an_empty_answer_leaves_the_conversation_usable(chat):
    """The model ending its answer at once gave an empty assistant message, which made every later turn
    '(not sent: not a conversation: empty content)' until /reset."""
    text, stream = chat.run(["hi", "hi again", "/quit"], [("", None), ("ok", None)])
    assert "assistant> (no answer)\n" in text and "assistant> ok\n" in text and "not sent" not in text
    assert chat.session.messages == [
        {"role": "user", "content": "hi again"},
        {"role": "assistant", "content": "ok"},
    ]
