"""Conversations rendered with an HF tokenizer's own chat template (`loom data prepare --chat --chat-template
tokenizer`): the Jinja "chat_template" of a tokenizer_config.json (Llama 3, Qwen, ...), applied by
transformers' apply_chat_template, so that the data, `loom chat` and an exported model all write what the
tokenizer's family writes. No token is added to the tokenizer: the template's special tokens are its own.

The loss mask is found by rendering prefixes. For the assistant message i, the text of messages[:i] with the
generation prompt must be the start of the text of messages[:i+1], which must be the start of the whole
conversation's text, and each must tokenize to a prefix of the whole conversation's ids; the assistant's ids
are those between the two, and the mask covers them up to and including the first special token the template
writes after the answer: its end-of-turn token (Llama 3's <|eot_id|>, Qwen's <|im_end|>), so the model learns
to stop. A template that writes no end-of-turn token is refused (HFChatTemplate.from_folder), a record whose
rendering breaks one of these rules is dropped, counted by reason.

Every conversation in the shards starts with the data's document separator, meta.json's tokenizer.eot_id (the
document mask and loom.data.sft.Conversations split conversations at it): the template's own first token when
it writes one that occurs nowhere else (Llama 3's <|begin_of_text|>), else a token of the tokenizer's
(bos, end-of-text or eos) put before the template's text ("prepended" in meta.json's "chat" entry).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from loom.data.tokenizers import EOT_ALIASES, HFTokenizer
from loom.errors import LoomError

CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where newer transformers save the template, beside the config
TEMPLATE_ERROR = "the chat template raised an error: "  # the drop reason of a conversation it fails on
HINT = (
    "--tokenizer DIR: a folder holding an HF tokenizer (tokenizer.json + tokenizer_config.json with a "
    '"chat_template"), e.g. one saved by save_pretrained; or --chat-template loom for loom\'s own template'
)


def _hf_message(m: dict) -> dict:
    """A message as transformers' chat templates read it: each tool call {"type": "function", "function":
    {"name", "arguments": an object}}."""
    if not m.get("tool_calls"):
        return m
    from loom.data.messages import call_text

    calls = [{"type": "function", "function": json.loads(call_text(c))} for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


# ---------------------------------------------------------------------------------------- the folder


def hf_tokenizer_dir(spec: str | Path) -> Path:
    """The folder of an HF tokenizer named by --tokenizer: the folder itself, or the folder of a
    tokenizer_config.json or tokenizer.json given by path; it must hold both files (refused otherwise)."""
    if str(spec) in ("char", "bpe"):
        raise LoomError(
            f"--chat-template tokenizer renders with an HF tokenizer's own chat_template; --tokenizer {spec} has "
            "none",
            hint=HINT,
        )
    p = Path(spec)
    folder = p.parent if p.is_file() and p.name in (CONFIG, "tokenizer.json") else p
    if not folder.is_dir():
        raise LoomError(f"--tokenizer '{spec}' is not a folder holding an HF tokenizer", hint=HINT)
    missing = [f for f in ("tokenizer.json", CONFIG) if not (folder / f).is_file()]
    if missing:
        raise LoomError(
            f"--chat-template tokenizer: '{folder}' has no {' and no '.join(missing)}"
            + (
                " (it is a loom run or data folder: its tokenizer has no chat template)"
                if _is_loom(folder)
                else ""
            ),
            hint=HINT,
        )
    return folder


def _is_loom(folder: Path) -> bool:
    return (folder / "meta.json").is_file() or (folder / "tokenizer" / "meta.json").is_file()


def check_template_config(folder: Path) -> None:
    """Refuse a tokenizer folder whose tokenizer_config.json is unreadable or holds no chat template."""
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoomError(f"cannot read '{folder / CONFIG}': {e}", hint=HINT) from None
    if not isinstance(config, dict):
        raise LoomError(f"'{folder / CONFIG}' is not a JSON object", hint=HINT)
    if not config.get("chat_template") and not (folder / TEMPLATE_FILE).is_file():
        raise LoomError(
            f"'{folder / CONFIG}' has no \"chat_template\": this tokenizer has no chat template of its own",
            hint="use --chat-template loom (loom's template, its chat tokens added to the tokenizer), or the "
            "tokenizer of the family's instruct/chat model",
        )


def import_transformers():
    """transformers, or a LoomError naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise LoomError(
            "--chat-template tokenizer renders conversations with transformers, which is not installed",
            hint="pip install 'loom[hf]'",
        ) from None
    return transformers


def check_tokenizer_template_spec(spec: str | Path) -> Path:
    """Everything --chat-template tokenizer needs, checked before any reading: the folder, its template and
    transformers. Returns the folder."""
    folder = hf_tokenizer_dir(spec)
    check_template_config(folder)
    import_transformers()
    return folder


# ---------------------------------------------------------------------------------------- the template


def _added(inner) -> dict[int, str]:
    """{id: text} of the tokenizer's added tokens (its special tokens among them)."""
    return {i: t.content for i, t in inner.get_added_tokens_decoder().items()}


def _special_strings(hf) -> dict[str, str]:
    """The tokenizer's named special tokens as text (bos_token, eos_token, ...): variables of the template."""
    return {k: v for k, v in hf.special_tokens_map.items() if k.endswith("_token") and isinstance(v, str)}


def _short(e: Exception) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 100 else text[:97] + "..."


class HFChatTemplate:
    """The chat template of an HF tokenizer, with ChatTemplate's interface: ids ({token text: id} of the
    special tokens the template writes), eot / eot_id (the document separator every conversation starts
    with), end_id (the end-of-turn id), stop_ids, render, render_many, prompt, jinja, encode_batch,
    check_content.

    Built by from_folder (preparing data: transformers' AutoTokenizer of the folder) or from_meta (a run or
    prepared data: the template and special tokens kept in meta.json's "chat" entry)."""

    kind = "tokenizer"

    def __init__(self, tok: HFTokenizer, hf, special: dict[str, str], inner=None):
        from tokenizers import Tokenizer

        self.tok = tok
        self.hf = hf  # a transformers tokenizer whose apply_chat_template renders the template
        self.source = hf.chat_template
        if isinstance(self.source, dict):  # several named templates: the default one
            self.source = self.source.get("default")
        if not isinstance(self.source, str) or not self.source:
            raise LoomError("the tokenizer has no (default) chat template", hint=HINT)
        self.special = dict(special)
        # the tokenizer as its file is: encodes rendered text (special tokens parsed), is saved with the data
        self.inner = inner if inner is not None else Tokenizer.from_str(tok.tok.to_str())
        self.vocab_size = self.inner.get_vocab_size(with_added_tokens=True)
        self.added = _added(self.inner)
        texts = sorted(set(self.added.values()), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._content = Tokenizer.from_str(self.inner.to_str())
        self._content.encode_special_tokens = True  # contents: special token text is text
        self.end_id: int | None = None
        self.eot_id: int | None = None
        self.eot: str | None = None
        self.prepended = False
        self.ids: dict[str, int] = {}
        self.stop_ids: tuple[int, ...] = ()
        self.origin = "the chat template"  # where it was read, for its errors (from_folder names the file)

    # ---- building

    @classmethod
    def from_folder(cls, spec: str | Path, conversations: list[tuple[str, list[dict]]]) -> HFChatTemplate:
        """The template of the tokenizer folder `spec`, its end-of-turn token and the separator settled on
        the first conversation it renders (a LoomError when it writes no end-of-turn token)."""
        from tokenizers import Tokenizer

        folder = check_tokenizer_template_spec(spec)
        transformers = import_transformers()
        try:
            hf = transformers.AutoTokenizer.from_pretrained(str(folder))
            inner = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the libraries raise many kinds for a malformed folder
            raise LoomError(f"cannot load the HF tokenizer of '{folder}': {_short(e)}", hint=HINT) from None
        t = cls(HFTokenizer(Tokenizer.from_str(inner.to_str())), hf, _special_strings(hf), inner)
        # a chat_template.jinja beside the config takes priority over its "chat_template" in transformers
        jinja_file = folder / TEMPLATE_FILE
        t.origin = (
            f"'{jinja_file}'" if jinja_file.is_file() else f"the \"chat_template\" of '{folder / CONFIG}'"
        )
        t._settle(conversations)
        return t

    @classmethod
    def from_meta(cls, tokenizer, meta: dict) -> HFChatTemplate:
        """The template of chat data prepared with --chat-template tokenizer (or of a run trained on it):
        meta.json's "chat" entry over the data's (the run's) tokenizer."""
        chat = meta.get("chat") or {}
        if not isinstance(tokenizer, HFTokenizer):
            raise LoomError("a tokenizer chat template needs the data's tokenizer.json, not a char tokenizer")
        keys = ("jinja", "end_id", "end_token", "special_tokens", "prepended", "tokens", "stop_ids")
        missing = [k for k in keys if k not in chat]
        eot_id = (meta.get("tokenizer") or {}).get("eot_id")
        if missing or not isinstance(eot_id, int):
            raise LoomError(
                f"meta.json's chat entry is incomplete (missing {', '.join(missing) or 'tokenizer.eot_id'})",
                hint="prepare the chat data again (loom data prepare --chat --chat-template tokenizer)",
            )
        if tokenizer.token_id(chat["end_token"]) != chat["end_id"]:
            raise LoomError(
                f"the tokenizer does not have the end-of-turn token {chat['end_token']} as id {chat['end_id']}",
                hint="use the tokenizer the chat data was prepared with",
            )
        from tokenizers import Tokenizer

        transformers = import_transformers()
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(tokenizer.tok.to_str()),
            chat_template=chat["jinja"],
            **chat["special_tokens"],
        )
        t = cls(tokenizer, hf, chat["special_tokens"])
        t.end_id, t.eot_id, t.prepended = int(chat["end_id"]), int(eot_id), bool(chat["prepended"])
        t.eot = tokenizer.tok.id_to_token(t.eot_id)
        t.ids = {str(k): int(v) for k, v in chat["tokens"].items()}
        t.stop_ids = tuple(int(i) for i in chat["stop_ids"])
        return t

    def _settle(self, conversations) -> None:
        """end_id, the separator and ids from the first conversation whose text renders as a prefix chain
        (records that do not are dropped later, with their reasons). None renders: left unsettled."""
        for _, messages in conversations:
            texts = self._texts(messages)
            if isinstance(texts, str):
                continue
            full, pairs = texts
            before, through = pairs[0]
            answer = self.inner.encode(through[len(before) :], add_special_tokens=False).ids
            end = next((i for i in answer if i in self.added), None)
            if end is None:
                raise LoomError(
                    "the tokenizer's chat template loses the end-of-turn token: it writes no special token after "
                    f"the assistant's answer ({through[len(before) :][-60:]!r}), so a model trained on it would "
                    "never learn to stop",
                    hint="use a chat template that ends each assistant turn with a special token (Llama 3's "
                    "<|eot_id|>, Qwen's <|im_end|>), or --chat-template loom",
                )
            self.end_id = end
            ids = self.inner.encode(full, add_special_tokens=False).ids
            self._separator(ids)
            self.ids = {self.added[i]: i for i in dict.fromkeys(ids) if i in self.added}
            self.ids.setdefault(self.added[end], end)
            if self.prepended:
                self.ids[self.eot] = self.eot_id
            eos = self.inner.token_to_id(self.special.get("eos_token") or "")
            self.stop_ids = tuple(dict.fromkeys(i for i in (end, eos) if i is not None))
            return

    def _separator(self, ids: list[int]) -> None:
        """The template's first token when it is a special token written only there, else one of the
        tokenizer's put before each conversation."""
        if ids and ids[0] in self.added and ids[0] != self.end_id and ids.count(ids[0]) == 1:
            self.eot_id, self.eot, self.prepended = ids[0], self.added[ids[0]], False
            return
        own = next((t for t in EOT_ALIASES if self.inner.token_to_id(t) is not None), None)
        for text in (self.special.get("bos_token"), own, self.special.get("eos_token")):
            i = self.inner.token_to_id(text) if text else None
            if i is not None and i != self.end_id and i not in ids:
                self.eot_id, self.eot, self.prepended = i, text, True
                return
        raise LoomError(
            "the tokenizer's chat template does not start a conversation with a token of its own, and the "
            "tokenizer has no bos, end-of-text or eos token the template does not also write: conversations "
            "could not be told apart in the data",
            hint="give the tokenizer a bos_token (tokenizer_config.json), or use --chat-template loom",
        )

    # ---- rendering

    def _text(self, messages: list[dict], generation: bool) -> str:
        """The template's text of `messages`; tool definitions (loom.data.messages' first "tools" message) go
        to its `tools`, and calls' arguments as objects: the template writes tools in its own format."""
        tools = None
        if messages and messages[0]["role"] == "tools":
            tools = [{"type": "function", "function": f} for f in json.loads(messages[0]["content"])]
            messages = messages[1:]
        messages = [_hf_message(m) for m in messages]
        return self.hf.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation
        )

    def _texts(self, messages: list[dict]):
        """(whole text, [(text before assistant turn i with the generation prompt, text through it)]) or the
        reason the template cannot be split into turns."""
        if messages[0]["role"] == "assistant":
            return "the assistant speaks first (the template cannot render the empty history before it)"
        try:
            full = self._text(messages, False)
            pairs = [
                (self._text(messages[:i], True), self._text(messages[: i + 1], False))
                for i, m in enumerate(messages)
                if m["role"] == "assistant"
            ]
        except Exception as e:  # a template's raise_exception, or any error of its code
            self._check_syntax(e)
            return TEMPLATE_ERROR + _short(e)
        for before, through in pairs:
            if not through.startswith(before):
                return "the template's generation prompt is not the start of the assistant's turn"
            if not full.startswith(through):
                return "the template writes a turn differently once later turns follow"
        return full, pairs

    def _check_syntax(self, e: Exception) -> None:
        """A template that does not compile (a syntax error, an unknown filter or test) fails on every
        conversation alike: one error naming the template, not a dropped record each."""
        import jinja2

        if isinstance(e, jinja2.TemplateSyntaxError):
            raise LoomError(
                f"{self.origin} is not a valid Jinja template: {e.message} (line {e.lineno} of the template)",
                hint="fix the template, or use --chat-template loom (loom's template, its chat tokens added)",
            ) from None

    def check_content(self, text: str) -> str | None:
        """Why `text` cannot be a message's content (a reason, as prepare_chat counts them), else None: the
        text of one of the tokenizer's added tokens, which the rendered text would turn into that token."""
        if self._special_re is not None and self._special_re.search(text):
            return "content contains the text of a special token of the tokenizer"
        return None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Messages' contents as ids, special tokens never parsed."""
        return [e.ids for e in self._content.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def render_results(self, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]] | str]:
        """Per conversation: (ids, mask) — mask 1 on each assistant answer and the end-of-turn token after it
        — or the reason it is dropped. The texts of all are tokenized in one batch."""
        if self.end_id is None:
            self._settle([("", m) for m in conversations])
        found, batch = [], []
        for messages in conversations:
            reason = next(filter(None, (self.check_content(m["content"]) for m in messages)), None)
            texts = reason or self._texts(messages)
            if not isinstance(texts, str):
                full, pairs = texts
                batch += [full, *(t for pair in pairs for t in pair)]
            found.append(texts)
        encoded = iter(e.ids for e in self.inner.encode_batch(batch, add_special_tokens=False))
        out = []
        for texts in found:
            if isinstance(texts, str):
                out.append(texts)
                continue
            full_ids = next(encoded)
            spans = [(next(encoded), next(encoded)) for _ in texts[1]]
            out.append(self._masked(full_ids, spans))
        return out

    def _masked(self, ids: list[int], spans) -> tuple[list[int], list[int]] | str:
        mask = [0] * len(ids)
        for before, through in spans:
            if ids[: len(before)] != before or ids[: len(through)] != through:
                return (
                    "the tokens of a turn change with the text after it (the template is not prefix-stable)"
                )
            answer = ids[len(before) : len(through)]
            k = next((j for j, i in enumerate(answer) if i in self.added), None)
            if k is None:
                return "the template wrote no end-of-turn token after an assistant's answer"
            if answer[k] != self.end_id:
                return f"another special token ({self.added[answer[k]]}) than the end-of-turn token after an answer"
            mask[len(before) : len(before) + k + 1] = [1] * (k + 1)
        if self.prepended:
            if self.eot_id in ids:
                return f"the template writes the conversation separator {self.eot} inside it"
            return [self.eot_id, *ids], [0, *mask]
        if not ids or ids[0] != self.eot_id or self.eot_id in ids[1:]:
            return f"the template does not start it with {self.eot} alone"
        return ids, mask

    def render_many(self, conversations: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
        """render of each conversation; a LoomError for the first that cannot be."""
        from loom.data.messages import check_messages

        for messages in conversations:
            check_messages(messages)
        out = self.render_results(conversations)
        reason = next((r for r in out if isinstance(r, str)), None)
        if reason:
            raise LoomError(f"cannot render a conversation with the tokenizer's chat template: {reason}")
        return out

    def render(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """(ids, mask) of a conversation as the data holds it."""
        return self.render_many([messages])[0]

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids a generation continues: apply_chat_template(messages, add_generation_prompt=True),
        tokenized, after the separator when the data has one prepended."""
        from loom.data.messages import check_messages

        check_messages(messages, need_assistant=False)
        reason = next(filter(None, (self.check_content(m["content"]) for m in messages)), None)
        if reason:
            raise LoomError(f"cannot write this message: {reason}")
        try:
            text = self._text(messages, True)
        except Exception as e:
            raise LoomError(f"the chat template refused the conversation: {_short(e)}") from None
        ids = self.inner.encode(text, add_special_tokens=False).ids
        return [self.eot_id, *ids] if self.prepended else ids

    def jinja(self) -> str:
        """The template for an export's tokenizer_config.json: the tokenizer's own, its special tokens set in
        it (the export's bos/eos may be other tokens) and the separator written first when the data has it
        prepended, so that transformers' apply_chat_template(..., add_generation_prompt=True), tokenized with
        special tokens parsed, is prompt(messages)."""
        head = "".join("{% set " + k + " = " + json.dumps(v) + " %}" for k, v in sorted(self.special.items()))
        # transformers renders with trim_blocks: the newline after the last tag is eaten, none of the template's
        head += "\n" if head else ""
        if self.prepended:
            head += "{{ " + json.dumps(self.eot) + " }}"
        return head + self.source

    def meta_entry(self) -> dict:
        """The template's part of meta.json's "chat" entry (from_meta builds it back)."""
        return {
            "template": "tokenizer",
            "jinja": self.source,
            "special_tokens": dict(self.special),
            "end_id": self.end_id,
            "end_token": self.added.get(self.end_id),
            "prepended": self.prepended,
            "tokens": dict(self.ids),
            "stop_ids": list(self.stop_ids),
        }

    def save(self, out_dir: str | Path) -> str:
        """The tokenizer as its file is (nothing added), into `out_dir`; returns the file name."""
        self.inner.save(str(Path(out_dir) / "tokenizer.json"))
        return "tokenizer.json"
