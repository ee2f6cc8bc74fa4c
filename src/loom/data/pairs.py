"""Preference pairs for `loom dpo`: a prompt with a chosen and a rejected answer, prepared as chat data.

`loom data prepare --pairs` reads JSONL (or Parquet) records {"prompt": str, "chosen": str, "rejected": str},
or {"messages": [the prompt's turns], "chosen": ..., "rejected": ...}; an answer is a string, an assistant
message, or a list of messages ending with one (TRL's conversational form, whose earlier turns are then the
prompt when the record gives none). Each pair becomes two conversations rendered with the chat template
(loom.data.chat_prepare's machinery): the prompt plus the chosen answer, then the prompt plus the rejected one,
in that order in the shards, so conversation 2i is pair i's chosen and 2i + 1 its rejected. The loss mask
covers the final answer only (its tokens and its end of turn), not an earlier assistant turn of the prompt.
meta.json holds the chat entry and a "preference" entry (the pairs of each split). A pair whose chosen equals
its rejected answer is dropped and counted, as is any record that is not a pair; preference tuning starts from
a chat model, so a run (or data folder) whose tokenizer has no chat tokens is refused (`loom sft` it first).

Batches (PairLoader): each row holds one conversation, padded with end-of-text tokens; a pair's chosen row is
followed by its rejected row, so any even micro-batch holds whole pairs. Each epoch visits the training pairs
in an order drawn from (seed, epoch); the global batch at step s is pairs [s*P, (s+1)*P) of the endless
sequence of epochs (P = train.batch_size / 2) whatever the world size, each data-parallel rank its slice.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import numpy as np
import torch

from loom import log
from loom.data.chat_prepare import (
    ChatSettings,
    Written,
    _render_all,
    _run_tokenizer_dir,
    _split,
    _template,
    start_prepare,
    write_chat_data,
)
from loom.data.loader import seq_chunk
from loom.data.messages import Drops, Messages, message_problem, read_records
from loom.data.sft import Conversations, _inputs_targets
from loom.data.slice import DataSlice
from loom.errors import LoomError

SAME = "chosen equals rejected"  # a pair that prefers nothing: dropped, counted under this reason


def is_preference_data(meta: dict) -> bool:
    """Whether a prepared directory holds preference pairs (loom data prepare --pairs)."""
    return isinstance(meta.get("preference"), dict)


# ------------------------------------------------------------------------------------------ records


def _answer(value) -> tuple[Messages | None, str | None]:
    """(the turns before the answer, the answer's text) of a record's chosen or rejected value, or (None, None)
    when it is no answer: a string, an assistant message, or a list of messages ending with one."""
    if isinstance(value, str):
        return [], value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value or not isinstance(value[-1], dict):
        return None, None
    last = value[-1]
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        return None, None
    return value[:-1], last["content"]


def record_pair(obj) -> tuple[tuple[Messages, str, str] | None, str | None]:
    """((prompt messages, chosen text, rejected text), None) for a preference record, else (None, the reason
    it is dropped)."""
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    if "chosen" not in obj or "rejected" not in obj:
        return None, "no chosen and rejected"
    (before_c, chosen), (before_r, rejected) = _answer(obj["chosen"]), _answer(obj["rejected"])
    if chosen is None or rejected is None:
        return None, "chosen or rejected is not an answer (a string or an assistant message)"
    if "messages" in obj:
        prompt = obj["messages"]
    elif "prompt" in obj:
        prompt = obj["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    else:
        prompt = before_c  # TRL's conversational pairs: the turns before the answer are the prompt
        if before_r != before_c:
            return None, "chosen and rejected follow different conversations"
    problem = message_problem(prompt, need_assistant=False)
    if problem:
        return None, f"prompt: {problem}"
    if prompt[-1]["role"] == "assistant":
        return None, "the prompt ends with an assistant turn"
    if not chosen or not rejected:
        return None, "empty content"
    if chosen == rejected:
        return None, SAME
    return (prompt, chosen, rejected), None


def read_pairs(paths: list[Path], drops: Drops) -> list[tuple[str, Messages, str, str]]:
    """(place, prompt, chosen, rejected) of every valid record of the inputs, in order; the others counted."""
    found = []
    for where, obj, reason in read_records(paths):
        pair, reason = (None, reason) if reason else record_pair(obj)
        if reason:
            drops.add(reason, where)
        else:
            found.append((where, *pair))
    return found


# ------------------------------------------------------------------------------------------ prepare


def final_answer_mask(mask: np.ndarray) -> np.ndarray:
    """The mask kept on its last run of ones only: the final answer (and its end of turn), not an earlier
    assistant turn of the prompt."""
    ones = np.flatnonzero(mask)
    out = np.zeros_like(mask)
    if not len(ones):
        return out
    start = ones[-1]
    while start > 0 and mask[start - 1]:
        start -= 1
    out[start : ones[-1] + 1] = 1
    return out


class _SideDrops:
    """The drops _render_all reports for single sides ("PLACE (chosen)", "PLACE (rejected)"), kept by side, so
    that a pair is counted once however many of its sides failed (both answers too long was two records)."""

    SIDES = (" (chosen)", " (rejected)")

    def __init__(self):
        self.by_side: dict[
            str, tuple[str, str]
        ] = {}  # "PLACE (side)" -> (its first reason, where it was said)

    def add(self, reason: str, where: str) -> None:
        for tag in self.SIDES:
            i = where.find(tag)
            if i >= 0:
                self.by_side.setdefault(where[: i + len(tag)], (reason, where))
                return
        raise AssertionError(f"a side's drop without its side: {where}")

    def pair(self, where: str) -> tuple[str, str] | None:
        """(reason, place) of the pair at `where` when a side of it was dropped (the chosen's first), else
        None; the place names the side, or both answers."""
        chosen, rejected = (self.by_side.get(where + tag) for tag in self.SIDES)
        if chosen is None or rejected is None:
            return chosen or rejected
        return chosen[0], chosen[1].replace(" (chosen)", " (both answers)", 1)


def _render_pairs(template, pairs, block_size: int, too_long: str, drops: Drops) -> tuple[list[tuple], int]:
    """((chosen, rejected) Rendered conversations of every pair whose two sides both render (and fit) and
    differ as tokens, each side's mask cut to its final answer; the number of sides truncated). A pair a side
    of which is dropped counts once in `drops`, under the first side's reason."""
    convs = []
    for where, prompt, chosen, rejected in pairs:
        convs.append((f"{where} (chosen)", [*prompt, {"role": "assistant", "content": chosen}]))
        convs.append((f"{where} (rejected)", [*prompt, {"role": "assistant", "content": rejected}]))
    sides = _SideDrops()
    kept, truncated = _render_all(template, convs, block_size, too_long, sides)
    by_place = {r.where: r for r in kept}
    out = []
    for where, *_ in pairs:
        c, r = by_place.get(f"{where} (chosen)"), by_place.get(f"{where} (rejected)")
        if c is None or r is None:
            drops.add(*sides.pair(where))  # the pair, once
            continue
        if np.array_equal(c.ids, r.ids):
            drops.add(f"{SAME} (as tokens)", where)
            continue
        c.mask, r.mask = final_answer_mask(c.mask), final_answer_mask(r.mask)
        out.append((c, r))
    return out, truncated


def from_base_recipe(base: str, pairs: str = "PAIRS.jsonl") -> str:
    """The commands that take a base run `base` to preference tuning: chat data with its tokenizer, `loom sft`
    into a sibling run `sft`, the pairs prepared with that run's tokenizer, `loom dpo` from it (each runs as
    written once CONVERSATIONS.jsonl is a file of conversations)."""
    b = Path(base)
    parent, sft = b.parent, b.parent / "sft"
    return (
        f"fine-tune it on conversations first, then prepare the pairs with that chat model's tokenizer: "
        f"loom data prepare --chat --input CONVERSATIONS.jsonl --tokenizer {b} --out data/chat && "
        f"loom sft --data.path=data/chat --model.init_from=run:{b} --run.dir={parent} --run.name=sft && "
        f"loom data prepare --pairs --input {pairs} --tokenizer {sft} --out data/pref && "
        f"loom dpo --data.path=data/pref --model.init_from=run:{sft}"
    )


def check_chat_model(
    spec: str, template, base_vocab: int, chat_template: str, pairs: str = "PAIRS.jsonl"
) -> None:
    """Preference tuning starts from a chat model: a run (or a prepared data folder) whose tokenizer lacks
    loom's chat tokens is a base model that never answered in the template (`pairs`: the input, for the
    hint's commands)."""
    if chat_template != "loom" or spec in ("char", "bpe") or _run_tokenizer_dir(spec) is None:
        return
    if base_vocab < template.tok.vocab_size:
        raise LoomError(
            f"'{spec}' has no chat tokens: preference tuning starts from a chat model, and this one never "
            "answered in the chat template",
            hint=from_base_recipe(spec, pairs),
        )


def _start_run(init_from: str) -> Path | None:
    """The run directory of model.init_from=run:DIR (or run:DIR/ckpt/step_N), None for another source."""
    if not init_from.startswith("run:"):
        return None
    p = Path(init_from[len("run:") :]).expanduser()
    return p.parent.parent if p.parent.name == "ckpt" else p


def _run_has_chat_tokens(run: Path) -> bool | None:
    """Whether a run's tokenizer (RUN/tokenizer/meta.json) holds loom's chat tokens; None: no such file."""
    from loom.data.loader import read_meta

    if not (run / "tokenizer" / "meta.json").is_file():
        return None
    return isinstance(read_meta(run / "tokenizer").get("chat"), dict)


def check_start_model(init_from: str, data_path: str, meta: dict) -> None:
    """`loom dpo`'s start model (the reference) must be a chat model: model.init_from=run:DIR of a base run
    (its tokenizer has no chat tokens) is refused, and the hint leads to a start that works: the chat model the
    pairs were prepared with, or the commands from the base (from_base_recipe). Pairs prepared for a base
    tokenizer (chat tokens added by the preparation) are refused the same way."""
    chat = meta.get("chat") or {}
    if chat.get("template") != "loom":
        return  # an HF tokenizer's own template: its model's chat tokens are its own
    run = _start_run(init_from)
    source = meta.get("source") if isinstance(meta.get("source"), str) else "PAIRS.jsonl"
    if run is not None and _run_has_chat_tokens(run) is False:
        made_for = Path(str(chat.get("base_tokenizer", "")))
        if chat.get("base_tokenizer") and _run_has_chat_tokens(made_for):
            hint = f"start from the chat model the pairs were prepared with: --model.init_from=run:{made_for}"
        else:
            hint = from_base_recipe(str(run), source)
        raise LoomError(
            f"model.init_from={init_from} is a base run (its tokenizer has no chat tokens): preference tuning "
            "starts from a chat model, one fine-tuned on conversations (loom sft)",
            hint=hint,
        )
    if chat.get("base_vocab_size", 0) < meta["vocab_size"]:
        if run is not None:  # a chat run: the pairs prepared with its tokenizer instead
            hint = (
                f"prepare the pairs with the chat model's tokenizer: loom data prepare --pairs --input {source} "
                f"--tokenizer {run} --out data/pref, then --data.path=data/pref"
            )
        else:
            hint = from_base_recipe("runs/base", source)
        raise LoomError(
            f"the pairs in {data_path} add chat tokens to their tokenizer: the model they were prepared "
            "for is a base model without chat tokens, which never answered in the chat template",
            hint=hint,
        )


def prepare_pairs(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer_spec: str,
    block_size: int,
    too_long: str = "drop",
    val_fraction: float = 0.1,
    seed: int = 1337,
    force: bool = False,
    vocab_size: int = 4096,
    chat_template: str = "loom",
) -> dict:
    """Prepare preference pairs into `out` as chat data (see the module docstring; the options are
    loom.data.chat_prepare.prepare_chat's). Returns the meta."""
    t0 = time.perf_counter()
    cfg = ChatSettings(tokenizer_spec, block_size, too_long, val_fraction, seed, vocab_size, chat_template)
    out, paths, drops = start_prepare(out, inputs, cfg, force)
    pairs = read_pairs(paths, drops)
    if not pairs:
        _no_pairs(paths, drops)
    # every text of both sides: a tokenizer trained here (char, bpe) must cover the rejected answers too
    convs = [(w, [*p, {"role": "assistant", "content": c + r}]) for w, p, c, r in pairs]
    template, kind, base_vocab, base_sha = _template(tokenizer_spec, chat_template, convs, vocab_size)
    given = str(inputs[0]) if len(inputs) == 1 else "PAIRS.jsonl"
    check_chat_model(tokenizer_spec, template, base_vocab, chat_template, given)
    rendered, truncated = _render_pairs(template, pairs, block_size, too_long, drops)
    for line in drops.lines():
        log.warn(f"dropped {line}")
    if not rendered:
        _no_pairs(paths, drops)
    val = set(_split(len(rendered), val_fraction, seed).tolist())
    split = {"train": [p for i, p in enumerate(rendered) if i not in val]}
    split["val"] = [p for i, p in enumerate(rendered) if i in val]
    parts = {s: [side for pair in split[s] for side in pair] for s in split}
    entry = {"pairs": {s: len(split[s]) for s in split}, "dropped": dict(drops.counts)}
    written = Written(template, kind, base_vocab, base_sha, paths, drops, truncated, 0)
    meta = write_chat_data(out, cfg, written, parts, force, {"preference": entry})
    log.info(
        f"prepared {out}: {len(rendered)} preference pair(s) (train {entry['pairs']['train']}, val "
        f"{entry['pairs']['val']}), {drops.total()} record(s) dropped, in {time.perf_counter() - t0:.1f}s"
    )
    return meta


def _no_pairs(paths: list[Path], drops: Drops) -> None:
    where = ", ".join(str(p) for p in paths)
    raise LoomError(
        f"no preference pair to prepare in {where}: {'; '.join(drops.lines()) or 'no records'}",
        hint='each line: {"prompt": "...", "chosen": "...", "rejected": "..."} with chosen != rejected (or '
        '"messages" for the prompt\'s turns); raise --block-size for long ones',
    )


# ------------------------------------------------------------------------------------------ batches


class Pairs:
    """The pairs of one split: its conversations (loom.data.sft.Conversations), 2i chosen and 2i + 1 rejected,
    each a row of block_size + 1 tokens of its own."""

    def __init__(self, data_dir: str | Path, split: str, block_size: int):
        self.convs = Conversations(data_dir, split, block_size)
        if len(self.convs) % 2:
            raise LoomError(
                f"the {split} split of '{data_dir}' holds {len(self.convs)} conversations, not pairs",
                hint="prepare the pairs again (loom data prepare --pairs)",
            )

    def __len__(self) -> int:
        return len(self.convs) // 2

    def rows(self, pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and masked targets (2 * len(pairs), T) of these pairs: chosen, rejected, chosen, ..."""
        sides = [self.convs.row([int(2 * p + side)]) for p in pairs for side in (0, 1)]
        return _inputs_targets(np.stack([s[0] for s in sides]), np.stack([s[1] for s in sides]))


class PairLoader:
    """DPO's training batches: the global batch at step s (batch_size rows: batch_size / 2 pairs), sliced for
    one data-parallel rank. The state also holds the reference model's log-probabilities of every training
    pair (set once before the first step: loom.train.dpo), so a resumed run keeps the reference it started
    with."""

    def __init__(self, data_dir: str | Path, batch_size: int, block_size: int, seed: int, part: DataSlice):
        if batch_size % (2 * part.dp_size):
            raise LoomError(
                f"train.batch_size={batch_size} rows do not split into whole pairs (2 rows each) over "
                f"{part.dp_size} data-parallel rank(s)",
                hint=f"use a train.batch_size that is a multiple of {2 * part.dp_size}",
            )
        self.pairs = Pairs(data_dir, "train", block_size)
        self.n_pairs, self.seed, self.part = batch_size // 2, seed, part
        self.cursor = 0  # global pairs consumed (all ranks together)
        self.reference: np.ndarray | None = None  # (pairs, 2) float32: chosen, rejected log-probabilities
        self._encoded: str | None = None  # the reference as state.json holds it (encoded once)

    def global_pairs(self, start: int, count: int) -> np.ndarray:
        """Pairs [start, start + count) of the endless sequence of epochs (each a seeded permutation)."""
        n = len(self.pairs)
        g = np.arange(start, start + count)
        epochs, at = g // n, g % n
        orders = {e: np.random.default_rng([self.seed, int(e)]).permutation(n) for e in np.unique(epochs)}
        return np.array([orders[e][i] for e, i in zip(epochs, at, strict=True)], dtype=np.int64)

    def local_pairs(self, start: int) -> np.ndarray:
        """This rank's pairs of the global batch that starts at pair `start`."""
        local = self.n_pairs // self.part.dp_size
        return self.global_pairs(start, self.n_pairs)[self.part.dp_rank * local :][:local]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.pairs.rows(self.local_pairs(self.cursor))
        self.cursor += self.n_pairs
        return seq_chunk(x, *self.part.cp), seq_chunk(y, *self.part.cp)

    def set_reference(self, logps: np.ndarray) -> None:
        self.reference = np.ascontiguousarray(logps, dtype=np.float32).reshape(len(self.pairs), 2)
        self._encoded = base64.b64encode(self.reference.tobytes()).decode("ascii")

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "kind": "pairs", "reference": self._encoded}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "pairs" or state.get("seed") != self.seed:
            raise LoomError(
                "the checkpoint was not written by a preference-tuning run of this seed",
                hint="resume with the run's own data.path and run.seed",
            )
        self.cursor = int(state["cursor"])
        if state.get("reference") is not None:
            ref = np.frombuffer(base64.b64decode(state["reference"]), dtype=np.float32)
            if ref.size != 2 * len(self.pairs):
                raise LoomError(
                    f"the checkpoint's reference holds {ref.size // 2} pairs, the data {len(self.pairs)}",
                    hint="resume with the data the run started with",
                )
            self.set_reference(ref)
