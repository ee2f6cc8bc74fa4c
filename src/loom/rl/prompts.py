"""The prompts RL samples from: a JSONL file, one row a prompt (`messages`, a conversation ending before the
assistant's turn, or `prompt`, one user message), with whatever fields its reward reads (the answer)."""

from __future__ import annotations

import json
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
        return row["messages"]
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    raise LoomError(
        f"{where}: a prompt row needs 'messages' or a 'prompt' string (it has {sorted(row)})",
        hint='one JSON object a line: {"prompt": "2+3=", "answer": "5"}',
    )


def read_rows(path: str | Path, field: str | None) -> list[dict]:
    """The file's rows, each checked to hold `field` (the reward's) before any work: a missing field is an
    error naming the first line that lacks it and how many do."""
    path = Path(path)
    if not path.is_file():
        raise LoomError(f"rl prompts '{path}' is not a file", hint="write them with scripts/make_arith.py")
    rows, lacking = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
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
    if lacking:
        raise LoomError(
            f"{path}: {len(lacking)} of {len(rows)} prompt rows lack the field '{field}' the reward reads "
            f"(first: line {lacking[0]})",
            hint="add it to every row, or name the row's field with rl.answer_field",
        )
    if not rows:
        raise LoomError(f"rl prompts '{path}' holds no rows")
    return rows


def load_prompts(path: str | Path, field: str | None, template, room: int) -> Prompts:
    """The rows of `path` with their prompt ids; a prompt longer than `room` tokens (block_size - the answer's
    rl.max_new_tokens) is skipped and counted, and none left is an error."""
    rows = read_rows(path, field)
    convs = [_messages(r, f"{path}:{i + 1}") for i, r in enumerate(rows)]
    keep_rows, keep_ids, skipped = [], [], 0
    for row, conv in zip(rows, convs, strict=True):
        ids = template.prompt(conv)
        if len(ids) > room:
            skipped += 1
            continue
        keep_rows.append(row)
        keep_ids.append(ids)
    if skipped:
        log.warn(f"{path}: {skipped} of {len(rows)} prompts skipped: longer than {room} tokens")
    if not keep_ids:
        raise LoomError(
            f"{path}: every prompt is longer than the {room} tokens left for it (model.block_size minus "
            "rl.max_new_tokens)",
            hint="lower rl.max_new_tokens, or use a model with a larger block_size",
        )
    return Prompts(keep_rows, keep_ids, skipped)


def rl_template(data_dir: Path, meta: dict):
    """The chat template RL prompts are written in (a base run's data has none: a clear error)."""
    tok = load_tokenizer(data_dir, meta) if meta.get("tokenizer") else None
    if tok is None or not isinstance(meta.get("chat"), dict):
        raise LoomError(
            f"loom rl samples answers in the chat template, and '{data_dir}' is not chat data (a base run's "
            "tokenizer has no chat tokens)",
            hint="SFT the base first (loom data prepare --chat ..., loom sft), then loom rl "
            "--data.path=CHAT_DATA --model.init_from=run:SFT_RUN",
        )
    return chat_template_of(tok, meta)
