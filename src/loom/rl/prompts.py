"""The prompts RL samples from: a JSONL file, one row a prompt (`messages`, a conversation ending before the
assistant's turn, or `prompt`, one user message), with whatever fields its reward reads (the answer).

A base run (its tokenizer has no chat tokens: R1-Zero's setting) takes `{"prompt": ...}` rows as raw text through
its own tokenizer (`TextTemplate`); its answers end at the end-of-text id or at one of `rl.stop`'s texts."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from loom import log
from loom.data.chat import chat_template_of
from loom.data.tokenizers import load_tokenizer
from loom.errors import LoomError


@dataclass
class Prompts:
    """Rows that fit (their fields as read) and their prompt ids (the chat template's generation prompt);
    `skipped`: rows dropped because prompt + rl.max_new_tokens would not fit in model.block_size."""

    rows: list[dict]
    ids: list[list[int]]
    skipped: int

    def __len__(self) -> int:
        return len(self.ids)


def _messages(row: dict, where: str) -> list[dict]:
    if "messages" in row:
        conv = row["messages"]
        ok = (
            isinstance(conv, list)
            and conv
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conv
            )
        )
        if not ok:
            raise LoomError(
                f'{where}: \'messages\' is a non-empty list of {{"role": ..., "content": ...}} objects',
                hint='e.g. {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}',
            )
        return conv
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    raise LoomError(
        f"{where}: a prompt row needs 'messages' or a 'prompt' string (it has {sorted(row)})",
        hint='one JSON object a line: {"prompt": "2+3=", "answer": "5"}',
    )


def read_numbered(path: str | Path, field: str | None) -> tuple[list[dict], list[int]]:
    """(the file's rows, the line number of each), each row checked to hold `field` (the reward's) before any
    work: a missing field is an error naming the first line that lacks it and how many do."""
    path = Path(path)
    if not path.is_file():
        raise LoomError(f"rl prompts '{path}' is not a file", hint="write them with scripts/make_arith.py")
    rows, numbers, lacking = [], [], []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LoomError(f"{path}: not UTF-8 text ({e})", hint="one JSON object a line, UTF-8") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise LoomError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise LoomError(f"{path}:{n}: a prompt row is a JSON object")
        if field and field not in row:
            lacking.append(n)
        rows.append(row)
        numbers.append(n)
    if lacking:
        raise LoomError(
            f"{path}: {len(lacking)} of {len(rows)} prompt rows lack the field '{field}' the reward reads "
            f"(first: line {lacking[0]})",
            hint="add it to every row, or name the row's field with rl.answer_field",
        )
    if not rows:
        raise LoomError(f"rl prompts '{path}' holds no rows")
    return rows, numbers


def _check_not_answered(conv: list[dict], answer, where: str) -> None:
    """A prompt whose text already ends with its answer ('2+3=5' for 5) is refused: sampling would reward
    copying it, and the held-out pass rate would measure nothing."""
    text = conv[-1]["content"].rstrip()
    want = str(answer).strip()
    if want and re.search(r"(?:[=:]|####)\s*" + re.escape(want) + r"$", text):
        raise LoomError(
            f"{where}: the prompt already ends with its answer {want!r} ({text[-40:]!r}): the model would be "
            "rewarded for copying it",
            hint='end each prompt before its answer (e.g. "2+3=" with the answer "5")',
        )


def load_prompts(path: str | Path, field: str | None, template, block_size: int, max_new: int) -> Prompts:
    """The rows of `path` with their prompt ids; a prompt longer than the room its answer leaves (block_size -
    max_new, rl.max_new_tokens) is skipped and counted, and none left is an error with the numbers. Errors name
    the file and line."""
    room = block_size - max_new
    rows, numbers = read_numbered(path, field)
    keep_rows, keep_ids, skipped, shortest = [], [], 0, None
    for row, n in zip(rows, numbers, strict=True):
        where = f"{path}:{n}"
        conv = _messages(row, where)
        if field:
            _check_not_answered(conv, row[field], where)
        ids = _prompt_ids(template, row, conv, where)
        if shortest is None or len(ids) < shortest[0]:
            shortest = (len(ids), n)
        if len(ids) > room:
            skipped += 1
            continue
        keep_rows.append(row)
        keep_ids.append(ids)
    if skipped:
        log.warn(f"{path}: {skipped} of {len(rows)} prompts skipped: longer than {room} tokens")
    if not keep_ids:
        raise LoomError(
            f"{path}: every prompt is longer than the {room} tokens its answer leaves (model.block_size="
            f"{block_size} minus rl.max_new_tokens={max_new}); the shortest is {shortest[0]} tokens (line "
            f"{shortest[1]})",
            hint=f"lower rl.max_new_tokens to {block_size - shortest[0]} or less, or use a model with a larger "
            "block_size",
        )
    return Prompts(keep_rows, keep_ids, skipped)


def _prompt_ids(template, row: dict, conv: list[dict], where: str) -> list[int]:
    """A row's prompt ids: the chat template's generation prompt, or a base run's raw text."""
    if isinstance(template, TextTemplate):
        if "messages" in row:
            raise LoomError(
                f"{where}: a base run (no chat tokens) takes plain prompts, and this row holds 'messages'",
                hint='write {"prompt": "..."} rows (the raw text the model continues), or SFT the base first',
            )
        return template.encode_prompt(row["prompt"], where)
    try:
        return template.prompt(conv)
    except (KeyError, TypeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
        raise LoomError(f"{where}: the chat template cannot write this prompt ({why})") from None


class TextTemplate:
    """A base run's prompts (R1-Zero style): a row's `prompt` is raw text through the run's own tokenizer, no
    chat tokens; an answer ends at the end-of-text id (or one of rl.stop's texts, the engine's stop texts)."""

    def __init__(self, tok):
        self.tok = tok
        self.eot_id = tok.eot_id
        self.stop_ids = (tok.eot_id,)

    def encode_prompt(self, text: str, where: str) -> list[int]:
        """The text's ids; text the tokenizer cannot write back as it was (a character outside a char
        vocabulary, an unknown token's stand-in) is an error naming the line: the model would see another
        prompt than the file's."""
        try:
            ids = self.tok.encode(text)
        except LoomError as e:
            raise LoomError(
                f"{where}: the base run's tokenizer cannot encode this prompt: {e.message}",
                hint="write prompts in the characters the base run was trained on (its tokenizer's vocabulary)",
            ) from None
        back = self.tok.decode(ids)
        if back != text:
            bad = next((c for c, d in zip(text, back, strict=False) if c != d), text[len(back) :][:1] or "?")
            raise LoomError(
                f"{where}: the base run's tokenizer cannot encode this prompt: {bad!r} does not come back from "
                f"its ids ({text[:40]!r} is read as {back[:40]!r})",
                hint="write prompts in the characters the base run was trained on (its tokenizer's vocabulary)",
            )
        if not ids:
            raise LoomError(f"{where}: an empty prompt", hint="a base run continues the prompt's text")
        return ids


def rl_template(data_dir: Path, meta: dict):
    """The template RL prompts are written in: the chat template of chat data, else (a base run's data) the raw
    text of `TextTemplate`; data with no tokenizer at all is an error."""
    tok = load_tokenizer(data_dir, meta) if meta.get("tokenizer") else None
    if tok is None:
        raise LoomError(
            f"loom rl decodes answers to score them, and '{data_dir}' has no tokenizer (token ids only)",
            hint="prepare the data with loom data prepare (its meta.json names the tokenizer)",
        )
    if not isinstance(meta.get("chat"), dict):
        return TextTemplate(tok)
    return chat_template_of(tok, meta)


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", ",": ","}


def parse_stops(spec: str) -> tuple[str, ...]:
    """rl.stop's texts, separated by commas; the escapes \\n, \\t, \\r, \\\\ and \\, (a comma inside a text)."""
    if not spec:
        return ()
    parts, cur, i = [], [], 0
    while i < len(spec):
        c = spec[i]
        if c == "\\" and i + 1 < len(spec) and spec[i + 1] in _ESCAPES:
            cur.append(_ESCAPES[spec[i + 1]])
            i += 2
            continue
        if c == ",":
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    if not all(parts):
        raise LoomError(f"rl.stop={spec!r} holds an empty text", hint="e.g. --rl.stop='\\n' (a newline)")
    return tuple(parts)


def check_stops(tok, stops: tuple[str, ...]) -> None:
    """Each stop text must be one the tokenizer can produce (its ids decode back to it): one that cannot would
    never end an answer, so every answer would run to rl.max_new_tokens (an error before any work)."""
    for s in stops:
        try:
            back = tok.decode(tok.encode(s))
        except LoomError as e:
            back, why = None, e.message
        else:
            why = f"its ids decode to {back!r}"
        if back != s:
            raise LoomError(
                f"rl.stop {s!r} can never match: the tokenizer cannot produce it ({why}), so no answer would end "
                "there",
                hint="use texts made of the tokenizer's own characters (e.g. --rl.stop='\\n'), or no rl.stop",
            )
