"""What a conversation is, for loom's chat template (loom.data.chat) and a tokenizer's own (loom.data.hf_chat):
OpenAI-style messages, each {"role": "system" | "user" | "assistant", "content": non-empty text}, a system
message only first, and (for training) at least one assistant turn."""

from __future__ import annotations

from loom.errors import LoomError

ROLES = ("system", "user", "assistant")


def message_problem(messages, need_assistant: bool = True) -> str | None:
    """Why a list of messages is not a conversation (a short reason, counted by prepare_chat), else None."""
    if not isinstance(messages, list) or not messages:
        return "messages is not a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return "a message is not an object"
        if m.get("role") not in ROLES:
            return "unknown role"
        content = m.get("content")
        if not isinstance(content, str):
            return "content is not a string"
        if not content:
            return "empty content"
        if m["role"] == "system" and i > 0:
            return "system message not first"
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
