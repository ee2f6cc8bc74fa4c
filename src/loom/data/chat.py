"""loom's chat template for supervised fine-tuning (chat SFT), and picking a data set's template.

The template is nanochat's: six special tokens delimit the messages, and every conversation starts with the
tokenizer's end-of-text id, the document separator of pretraining, so that data.doc_mask keeps each
conversation's attention to itself:

    <|endoftext|> <|system_start|> ... <|system_end|> <|user_start|> ... <|user_end|>
                  <|assistant_start|> ... <|assistant_end|> <|user_start|> ... (more turns)

The loss mask (1 = trained on, as a target) covers the assistant's content tokens and its
<|assistant_end|>, so the model learns what to say and when to stop; the end-of-text id, the system and user
messages and the <|assistant_start|> tokens are context only (the prompt a generation continues is the
history followed by <|assistant_start|>: ChatTemplate.prompt).

Special token text inside a message is never turned into the special id: message content is encoded with
special tokens not parsed (a char tokenizer has no way to; a `tokenizers` tokenizer is told so with
`encode_special_tokens`), so a user cannot inject `<|assistant_end|>` or an end-of-text by typing it.

Tool calls (loom.data.messages: a record's "tools", an assistant's "tool_calls", "tool" messages) take six more
special tokens, added only to the tokenizer of chat data that has tool calls (a run without them has no tool
roles, and its chat template refuses tools):

    <|endoftext|> <|tools_start|> [functions as JSON] <|tools_end|> <|system_start|> ... <|user_start|> ...
    <|assistant_start|> text? <|tool_call_start|> {"name": ..., "arguments": {...}} <|tool_call_end|> ...
    <|assistant_end|> <|tool_start|> result <|tool_end|> ... <|assistant_start|> ...

The calls are the assistant's, trained on like its text; the definitions and results are context only.

`--chat-template tokenizer` renders with an HF tokenizer's own Jinja chat template instead (Llama 3, Qwen):
loom.data.hf_chat, its HFChatTemplate has ChatTemplate's interface; chat_template_of picks the one a prepared
data set (or a run trained on it) was written with. Writing chat data: loom.data.chat_prepare.
"""

from __future__ import annotations

import json

from loom.data.messages import Messages, check_messages, message_texts
from loom.data.tokenizers import CharTokenizer, HFTokenizer
from loom.errors import LoomError

SYSTEM_START, SYSTEM_END = "<|system_start|>", "<|system_end|>"
USER_START, USER_END = "<|user_start|>", "<|user_end|>"
ASSISTANT_START, ASSISTANT_END = "<|assistant_start|>", "<|assistant_end|>"
CHAT_TOKENS = (SYSTEM_START, SYSTEM_END, USER_START, USER_END, ASSISTANT_START, ASSISTANT_END)
TOOLS_START, TOOLS_END = "<|tools_start|>", "<|tools_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
TOOL_START, TOOL_END = "<|tool_start|>", "<|tool_end|>"
TOOL_TOKENS = (TOOLS_START, TOOLS_END, TOOL_CALL_START, TOOL_CALL_END, TOOL_START, TOOL_END)
ROLE_TOKENS = {
    "system": (SYSTEM_START, SYSTEM_END),
    "user": (USER_START, USER_END),
    "assistant": (ASSISTANT_START, ASSISTANT_END),
    "tool": (TOOL_START, TOOL_END),
    "tools": (TOOLS_START, TOOLS_END),
}


# ---------------------------------------------------------------------------------------- the template


def add_chat_tokens(tok: CharTokenizer | HFTokenizer, tools: bool = False) -> CharTokenizer | HFTokenizer:
    """The tokenizer with the chat tokens (and with `tools` the tool tokens) added as special tokens after its
    existing ids, in CHAT_TOKENS' (then TOOL_TOKENS') order (those it already has are kept: idempotent). `tok`
    itself is not changed."""
    missing = [t for t in (*CHAT_TOKENS, *(TOOL_TOKENS if tools else ())) if tok.token_id(t) is None]
    if not missing:
        return tok
    if isinstance(tok, CharTokenizer):
        return CharTokenizer(tok.chars, [*tok.specials, *missing])
    from tokenizers import AddedToken, Tokenizer

    inner = Tokenizer.from_str(tok.tok.to_str())
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    out = HFTokenizer(inner)
    ids = [out.token_id(t) for t in missing]
    if sorted(ids) != list(range(tok.vocab_size, tok.vocab_size + len(missing))):
        raise LoomError(  # the library reused ids of the tokenizer's vocabulary: its ids would change meaning
            f"adding the chat tokens gave them ids {ids}, not the next free ones from {tok.vocab_size}",
            hint="use a tokenizer.json whose added tokens are numbered after its vocabulary",
        )
    return out


def _content_encoder(tok: CharTokenizer | HFTokenizer):
    """encode_batch(texts) -> ids of each with special tokens not parsed, or None when this `tokenizers`
    version cannot (then content holding a special token's text is refused: ChatTemplate.check_content)."""
    if isinstance(tok, CharTokenizer):
        return tok.encode_batch  # characters only: a special token's text is its characters
    from tokenizers import Tokenizer

    inner = Tokenizer.from_str(tok.tok.to_str())
    if not hasattr(inner, "encode_special_tokens"):  # tokenizers < 0.19
        return None
    inner.encode_special_tokens = True
    # the Rust side encodes a batch on all cores
    return lambda texts: [e.ids for e in inner.encode_batch(texts, add_special_tokens=False)]


class ChatTemplate:
    """loom's chat template over a tokenizer that has the chat tokens (add_chat_tokens).

    ids: {token text: id} of the chat tokens; end_id: <|assistant_end|>'s id; stop_ids: the ids that end a
    generated answer (end_id, then the end-of-text id)."""

    def __init__(self, tok: CharTokenizer | HFTokenizer):
        missing = [t for t in CHAT_TOKENS if tok.token_id(t) is None]
        if missing:
            raise LoomError(
                f"the tokenizer has no chat tokens ({', '.join(missing)})",
                hint="add them with loom.data.chat.add_chat_tokens, or prepare the data with --chat",
            )
        self.tok = tok
        # the tool roles, when the tokenizer has all their tokens (chat data prepared with tool calls)
        self.tools = all(tok.token_id(t) is not None for t in TOOL_TOKENS)
        self.ids = {t: tok.token_id(t) for t in (*CHAT_TOKENS, *(TOOL_TOKENS if self.tools else ()))}
        self.eot = tok.eot
        self.eot_id = tok.eot_id
        self.end_id = self.ids[ASSISTANT_END]
        self.stop_ids = (self.end_id, self.eot_id)
        self._encode_batch = _content_encoder(tok)
        self._specials = (*CHAT_TOKENS, self.eot)

    def check_content(self, text: str) -> str | None:
        """Why `text` cannot be a message's content (a reason, as prepare_chat counts them), else None."""
        if self._encode_batch is None and any(t in text for t in self._specials):
            return "content contains a special token (this tokenizers version parses them)"
        return None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Messages' contents as ids, special tokens never parsed (see the module docstring)."""
        if self._encode_batch is not None:
            return self._encode_batch(texts)
        reason = next(filter(None, map(self.check_content, texts)), None)
        if reason:
            raise LoomError(f"cannot encode a message: {reason}", hint="pip install -U tokenizers")
        return self.tok.encode_batch(texts)

    def encode(self, text: str) -> list[int]:
        """A message's content as ids, special tokens never parsed."""
        return self.encode_batch([text])[0]

    def render(self, messages: Messages) -> tuple[list[int], list[int]]:
        """(ids, mask) of a conversation: the end-of-text id, then START + content + END per message; mask 1
        on the assistant's content tokens and its <|assistant_end|> (the targets trained on), else 0."""
        return self.render_many([messages])[0]

    def render_many(self, conversations: list[Messages]) -> list[tuple[list[int], list[int]]]:
        """render of each conversation, their contents encoded in one batch."""
        for messages in conversations:
            check_messages(messages)
            self._check_tools(messages)
        texts = iter(self.encode_batch([t for c in conversations for m in c for t in message_texts(m)]))
        out = []
        for messages in conversations:
            ids, mask = [self.eot_id], [0]
            for m in messages:
                part = self._message_ids(m, texts)
                trained = int(m["role"] == "assistant")
                ids += part
                mask += [0] + [trained] * (len(part) - 1)
            out.append((ids, mask))
        return out

    def _message_ids(self, m: dict, texts) -> list[int]:
        """START + content (+ each tool call between its tokens) + END of one message; `texts` yields the
        encoded message_texts of the messages in order."""
        start, end = ROLE_TOKENS[m["role"]]
        ids = [self.ids[start], *next(texts)]
        for _ in m.get("tool_calls") or ():
            ids += [self.ids[TOOL_CALL_START], *next(texts), self.ids[TOOL_CALL_END]]
        return ids + [self.ids[end]]

    def _check_tools(self, messages: Messages) -> None:
        if not self.tools and any(m["role"] in ("tool", "tools") or m.get("tool_calls") for m in messages):
            raise LoomError(
                "this chat template has no tool roles: its tokenizer has no tool tokens "
                f"({', '.join(TOOL_TOKENS)})",
                hint="prepare chat data that has tool calls (loom data prepare --chat), and fine-tune on it",
            )

    def prompt(self, messages: Messages) -> list[int]:
        """The ids a generation continues: the end-of-text id, the history as render writes it, then
        <|assistant_start|> (transformers' add_generation_prompt). Messages may end with any role."""
        check_messages(messages, need_assistant=False)
        self._check_tools(messages)
        texts = iter(self.encode_batch([t for m in messages for t in message_texts(m)]))
        ids = [self.eot_id]
        for m in messages:
            ids += self._message_ids(m, texts)
        return ids + [self.ids[ASSISTANT_START]]

    def jinja(self) -> str:
        """A Jinja chat template (tokenizer_config.json's "chat_template") whose text, applied by transformers'
        apply_chat_template(messages, tokenize=False, add_generation_prompt=True) and tokenized with the
        special tokens parsed, is prompt(messages) (without add_generation_prompt: render's ids).

        One line, every token text a quoted literal: transformers renders templates with trim_blocks and
        lstrip_blocks, which must not change it."""

        def lit(text: str) -> str:
            return "{{ " + json.dumps(text) + " }}"

        parts = [lit(self.eot), "{% for message in messages %}"]
        # (the tool roles' messages only: an assistant's tool_calls and transformers' `tools` are not written)
        roles = [r for r in ROLE_TOKENS if r in ("system", "user", "assistant") or self.tools]
        for i, (role, (start, end)) in enumerate((r, ROLE_TOKENS[r]) for r in roles):
            parts.append(("{% if" if i == 0 else "{% elif") + f" message['role'] == '{role}' %}}")
            parts.append(lit(start) + "{{ message['content'] }}" + lit(end))
        parts.append("{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}")
        parts.append("{% endfor %}{% if add_generation_prompt %}" + lit(ASSISTANT_START) + "{% endif %}")
        return "".join(parts)


def chat_template_of(tokenizer, meta: dict):
    """The chat template a prepared chat data set was written with (meta.json's "chat" entry; a run's
    tokenizer/meta.json is its data's): loom's ChatTemplate over `tokenizer`, or, for data prepared with
    --chat-template tokenizer, the tokenizer's own (loom.data.hf_chat.HFChatTemplate)."""
    chat = meta.get("chat")
    if tokenizer is None or not isinstance(chat, dict):
        raise LoomError(
            'not chat data: meta.json has no "chat" entry (or no tokenizer), so there is no chat template',
            hint="prepare conversations with loom data prepare --chat, and fine-tune on them",
        )
    template = chat.get("template", "loom")
    if template == "tokenizer":
        from loom.data.hf_chat import HFChatTemplate

        return HFChatTemplate.from_meta(tokenizer, meta)
    if template != "loom":
        raise LoomError(
            f"unknown chat template '{template}' in meta.json", hint="prepare the chat data again"
        )
    return ChatTemplate(tokenizer)
