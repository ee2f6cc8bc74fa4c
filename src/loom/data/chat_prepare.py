"""`loom data prepare --chat`: conversations (JSONL) into chat data for supervised fine-tuning.

On disk a chat data set is a prepared data directory as `loom data prepare` writes it (llm.c shards
`{split}_000000.bin`, the tokenizer file, meta.json) plus, beside each shard, its loss mask
`{split}_000000.mask.npy` (np.uint8, one entry per token: 1 on the targets trained on) and a "chat" entry in
meta.json (the template, counts, what was dropped, the base tokenizer). The template is loom's
(loom.data.chat, its chat tokens added to the tokenizer) or the tokenizer's own (loom.data.hf_chat).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loom import __version__, log
from loom.data.chat import ChatTemplate, add_chat_tokens
from loom.data.formats import LOSS_MASK_SUFFIX
from loom.data.messages import Drops, check_inputs, message_texts, read_conversations
from loom.data.shards import version_for_vocab, write_shard
from loom.data.tokenizer_formats import sentencepiece_to_tokenizer
from loom.data.tokenizers import (
    CharTokenizer,
    HFTokenizer,
    check_bpe_vocab,
    load_given_tokenizer,
    load_tokenizer,
    run_tokenizer_dir,
    tokenizer_files,
    tokenizer_hash,
)
from loom.errors import LoomError
from loom.outputs import check_apart, check_replaceable, replace_output, write_marker

SHARD_TOKENS = 1 << 27  # a split longer than this is cut into more shards (at conversation boundaries)


# ---------------------------------------------------------------------------------------- tokenizers


def _run_tokenizer_dir(spec: str) -> Path | None:
    """The folder of a tokenizer with its meta.json: a run's `<run>/tokenizer/`, or a prepared data folder."""
    p = Path(spec)
    if (p / "tokenizer" / "meta.json").is_file():
        return p / "tokenizer"
    if (p / "meta.json").is_file():
        return p
    if (p / "config.toml").is_file():  # a run without its tokenizer/: named as such
        return run_tokenizer_dir(p)
    return None


def run_block_size(spec: str) -> int | None:
    """model.block_size of the run directory `spec` (its config.toml), or None when `spec` is not a run: the
    context length of the model the chat data will fine-tune."""
    path = Path(spec) / "config.toml"
    if spec in ("char", "bpe") or not path.is_file():
        return None
    from loom.config import config_from_dict, load_toml

    return config_from_dict(load_toml(path)).model.block_size


def check_tokenizer_spec(spec: str, vocab_size: int, chat_template: str = "loom") -> None:
    """Refuse a --tokenizer (and --chat-template) that names nothing usable, before any reading."""
    if chat_template == "tokenizer":
        from loom.data.hf_chat import check_tokenizer_template_spec

        check_tokenizer_template_spec(spec)
    elif chat_template != "loom":
        raise LoomError(f"unknown --chat-template '{chat_template}'", hint="use loom or tokenizer")
    elif spec == "bpe":
        check_bpe_vocab(vocab_size)
    elif spec != "char" and not Path(spec).exists():  # a typo'd run folder is not a bad tokenizer *file*
        raise LoomError(
            f"--tokenizer '{spec}' does not exist",
            hint="give a run folder (its tokenizer/: the model to fine-tune), a prepared data folder, a "
            "tokenizer.json, sentencepiece .model or .tiktoken file or a folder holding one, or char / bpe to "
            "train one on the conversations",
        )
    elif spec != "char" and _run_tokenizer_dir(spec) is None:
        tokenizer_files(spec)


def base_tokenizer(
    spec: str, texts: list[str], vocab_size: int
) -> tuple[CharTokenizer | HFTokenizer, str, str]:
    """(tokenizer, kind, sha256 of its content) before the chat tokens: char or bpe trained on `texts`, a
    tokenizer.json (or gpt2's files), or the tokenizer of a run directory / prepared data folder."""
    from loom.data.formats import read_meta

    d = _run_tokenizer_dir(spec) if spec not in ("char", "bpe") else None
    if d is not None:
        meta = read_meta(d)
        sha = tokenizer_hash(d, meta)
        if sha is None:
            raise LoomError(
                f"'{spec}' has no tokenizer (its data had token ids only)",
                hint="give --tokenizer char, bpe or a tokenizer.json",
            )
        tok = load_tokenizer(d, meta)
        kind = meta["tokenizer"].get("kind", "tokenizer.json")
        return _chat_ready(tok, spec), "tokenizer.json" if kind == "sentencepiece" else kind, sha
    if spec == "char":
        tok, kind = CharTokenizer.train(texts), "char"
    elif spec == "bpe":
        t0 = time.perf_counter()
        tok, kind = HFTokenizer.train(texts, vocab_size), "bpe"
        log.info(f"trained a byte-level BPE (vocab {tok.vocab_size:,}) in {time.perf_counter() - t0:.1f}s")
    else:
        tok, kind = load_given_tokenizer(spec), "tokenizer.json"
    # a sentencepiece model's hash is its own (what a run pretrained with it records: loom.train.finetune)
    sha = _hash_of(tok, tok.kind if tok.kind == "sentencepiece" else kind)
    return _chat_ready(tok, spec), kind, sha


def _chat_ready(tok, spec: str):
    """The tokenizer loom's chat tokens can be added to: a sentencepiece model becomes its tokenizer.json
    (transformers' converter, the library's ids: `loom data tokenizer convert --to hf`); the others as they are."""
    if tok.kind != "sentencepiece":
        return tok
    out = HFTokenizer(sentencepiece_to_tokenizer(tok.proto))
    log.info(
        f"--chat with the sentencepiece model '{spec}': its tokenizer.json (the library's ids) gets the chat "
        f"tokens after its {out.vocab_size:,} ids"
    )
    return out


def _hash_of(tok, kind: str) -> str:
    """tokenizer_hash of a tokenizer as prepared data would record it (saved, then hashed by content)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return tokenizer_hash(d, {"tokenizer": {"kind": kind, "file": tok.save(d)}})


# ------------------------------------------------------------------------------------------- prepare


@dataclass
class Rendered:
    """One conversation as it goes into a split."""

    where: str
    ids: np.ndarray  # int64 token ids
    mask: np.ndarray  # uint8, 1 on the targets trained on
    content_bytes: int  # UTF-8 bytes of the messages' contents (for bytes_per_token_val)
    content_tokens: int  # tokens that are not the template's


RENDER_BATCH = 4096  # conversations encoded per call of the tokenizer


def _render_all(template, convs, block_size: int, too_long: str, drops: Drops):
    """Render every conversation and apply the too-long policy. Returns (kept, number truncated)."""
    if not isinstance(template, ChatTemplate):  # the tokenizer's own template (loom.data.hf_chat)
        return _render_hf(template, convs, block_size, too_long, drops)
    ok = []
    for where, messages in convs:
        reason = next(
            filter(None, (template.check_content(t) for m in messages for t in message_texts(m))), None
        )
        if reason:
            drops.add(reason, where)
        elif (c := _missing_char(template.tok, messages)) is not None:
            drops.add("a character not in the tokenizer's vocabulary", f"{where} {c!r} U+{ord(c):04X}")
        else:
            ok.append((where, messages))
    special = np.array(sorted({*template.ids.values(), template.eot_id}))
    kept, truncated = [], 0
    for i in range(0, len(ok), RENDER_BATCH):
        part = ok[i : i + RENDER_BATCH]
        rendered = template.render_many([m for _, m in part])
        for (where, messages), (ids, mask) in zip(part, rendered, strict=True):
            fitted = _fit(ids, mask, block_size, too_long, drops, where)
            if fitted is None:
                continue
            truncated += len(fitted[0]) < len(ids)
            ids = np.array(fitted[0], dtype=np.int64)
            n_content = int(len(ids) - np.isin(ids, special).sum())
            nbytes = sum(len(m["content"].encode("utf-8")) for m in messages)
            kept.append(Rendered(where, ids, np.array(fitted[1], dtype=np.uint8), nbytes, n_content))
    return kept, truncated


def _missing_char(tok, messages) -> str | None:
    """The first character of the messages that a char tokenizer (given by the user: a run's, a prepared data
    folder's) does not have, named in the drop; None for a byte-level tokenizer, which encodes any text."""
    if not isinstance(tok, CharTokenizer):
        return None
    return next((c for m in messages for t in message_texts(m) for c in t if c not in tok.stoi), None)


def _fit(ids: list[int], mask: list[int], block_size: int, too_long: str, drops: Drops, where: str):
    """(ids, mask) within block_size + 1 tokens by the too-long policy, or None when dropped (counted)."""
    if len(ids) <= block_size + 1:
        return ids, mask
    if too_long == "drop":
        drops.add(f"longer than --block-size + 1 = {block_size + 1} tokens", where)
        return None
    ids, mask = ids[: block_size + 1], mask[: block_size + 1]
    if not any(mask):
        drops.add(f"no trained token in the first {block_size + 1} tokens (truncated)", where)
        return None
    return ids, mask


def _render_hf(template, convs, block_size: int, too_long: str, drops: Drops):
    """_render_all with the tokenizer's template: a conversation it cannot split into turns is dropped with
    its reason. Content tokens (bytes_per_token_val) are the messages' contents encoded alone."""
    kept, truncated = [], 0
    for i in range(0, len(convs), RENDER_BATCH):
        part = convs[i : i + RENDER_BATCH]
        results = template.render_results([m for _, m in part])
        lengths = iter(map(len, template.encode_batch([m["content"] for _, c in part for m in c])))
        for (where, messages), result in zip(part, results, strict=True):
            n_content = sum(next(lengths) for _ in messages)
            if isinstance(result, str):
                drops.add(result, where)
                continue
            fitted = _fit(*result, block_size, too_long, drops, where)
            if fitted is None:
                continue
            truncated += len(fitted[0]) < len(result[0])
            ids, mask = np.array(fitted[0], dtype=np.int64), np.array(fitted[1], dtype=np.uint8)
            if len(ids) < len(result[0]):  # the share of the contents that is left
                n_content = min(n_content, len(ids))
            nbytes = sum(len(m["content"].encode("utf-8")) for m in messages)
            kept.append(Rendered(where, ids, mask, nbytes, n_content))
    return kept, truncated


def _split(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """Indices of the val records (sorted): a seeded shuffle's first round(n * val_fraction), at least one
    when there are two or more records, never all."""
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return np.sort(np.random.default_rng([seed, 34]).permutation(n)[:n_val])


def _write_split(tmp: Path, split: str, convs: list[Rendered], version: int) -> dict:
    """Shards and masks of one split (cut at conversation boundaries past SHARD_TOKENS)."""
    groups, cur, n = [], [], 0
    for c in convs:
        if cur and n + len(c.ids) > SHARD_TOKENS:
            groups.append(cur)
            cur, n = [], 0
        cur.append(c)
        n += len(c.ids)
    groups.append(cur)  # an empty split still gets one (empty) shard
    tokens = 0
    for i, group in enumerate(groups):
        ids = np.concatenate([c.ids for c in group]) if group else np.zeros(0, np.int64)
        mask = np.concatenate([c.mask for c in group]) if group else np.zeros(0, np.uint8)
        shard = tmp / f"{split}_{i:06d}.bin"
        write_shard(shard, ids, version)
        with open(shard.with_name(shard.name.removesuffix(".bin") + LOSS_MASK_SUFFIX), "wb") as f:
            np.save(f, mask, allow_pickle=False)
        tokens += len(ids)
    return {"tokens": tokens, "documents": len(convs), "shards": len(groups)}


@dataclass
class ChatSettings:
    """The options of one `loom data prepare --chat` (see prepare_chat)."""

    tokenizer: str
    block_size: int
    too_long: str
    val_fraction: float
    seed: int
    vocab_size: int
    chat_template: str = "loom"  # loom | tokenizer (the HF tokenizer's own: loom.data.hf_chat)

    def check(self) -> None:
        """Refuse settings outside their domain, before any reading."""
        if self.too_long not in ("drop", "truncate"):
            raise LoomError(f"unknown --too-long '{self.too_long}'", hint="use drop or truncate")
        if self.block_size < 1:
            raise LoomError(f"--block-size must be >= 1, got {self.block_size}")
        if not 0.0 < self.val_fraction < 1.0:
            raise LoomError(f"--val-fraction must be between 0 and 1, got {self.val_fraction}")
        check_tokenizer_spec(self.tokenizer, self.vocab_size, self.chat_template)


def prepare_chat(
    inputs: list[str | Path],
    out: str | Path,
    tokenizer_spec: str = "char",
    block_size: int = 1024,
    too_long: str = "drop",
    val_fraction: float = 0.1,
    seed: int = 1337,
    force: bool = False,
    vocab_size: int = 4096,
    chat_template: str = "loom",
) -> dict:
    """Prepare conversations (JSONL: {"messages": [...]} or {"prompt", "completion"} per line) for SFT into
    `out`: token shards, loss masks, the tokenizer with the chat tokens, meta.json. Returns the meta.

    tokenizer_spec: char | bpe (trained on the conversations' text; vocab_size) | a tokenizer.json (or a
    folder with one) | a run directory (its `tokenizer/`: the model to fine-tune) or a prepared data folder.
    chat_template: loom (loom's template, its chat tokens added to the tokenizer) | tokenizer (the Jinja
    "chat_template" of the HF tokenizer folder tokenizer_spec, nothing added: loom.data.hf_chat).
    too_long: drop | truncate, for a conversation of more than block_size + 1 tokens. Every dropped record is
    counted by reason and reported; all dropped is an error. Written into `.<out>.loom-tmp` beside `out`,
    renamed once complete."""
    t0 = time.perf_counter()
    cfg = ChatSettings(tokenizer_spec, block_size, too_long, val_fraction, seed, vocab_size, chat_template)
    out, paths, drops = start_prepare(out, inputs, cfg, force)
    convs = read_conversations(paths, drops)
    if not convs:
        _all_dropped(paths, drops)
    template, kind, base_vocab, base_sha = _template(tokenizer_spec, chat_template, convs, vocab_size)
    kept, truncated = _render_all(template, convs, block_size, too_long, drops)
    _warn_dropped(template, drops, kept, truncated, block_size, paths)
    parts, repeats = _split_kept(kept, val_fraction, seed)
    written = Written(template, kind, base_vocab, base_sha, paths, drops, truncated, repeats)
    meta = write_chat_data(out, cfg, written, parts, force)
    _report(out, meta, time.perf_counter() - t0)
    return meta


@dataclass
class Written:
    """What a chat data set's meta.json records beside its splits (write_chat_data)."""

    template: object  # loom's ChatTemplate or the tokenizer's (loom.data.hf_chat)
    kind: str  # the tokenizer's kind
    base_vocab: int  # the base tokenizer's vocabulary, before the chat tokens
    base_sha: str | None  # its sha256 (None: the data's own tokenizer, nothing added)
    paths: list[Path]
    drops: Drops
    truncated: int
    repeats: int


def write_chat_data(
    out: Path, cfg: ChatSettings, w: Written, parts: dict, force: bool, extra: dict | None = None
) -> dict:
    """The split conversations `parts` ({train, val}: Rendered) written as chat data into `out` (through
    `.<out>.loom-tmp` beside it, renamed once complete): shards, loss masks, the tokenizer, meta.json (with
    `extra`'s entries). Returns the meta."""
    tmp = out.with_name(f".{out.name}.loom-tmp")
    _fresh_tmp(tmp, force)
    template = w.template
    try:
        file = template.tok.save(tmp) if isinstance(template, ChatTemplate) else template.save(tmp)
        info = {"kind": w.kind, "file": file, "eot_id": template.eot_id}
        info["sha256"] = tokenizer_hash(tmp, {"tokenizer": info})
        vocab = template.vocab_size if cfg.chat_template == "tokenizer" else template.tok.vocab_size
        version = version_for_vocab(vocab)
        splits = {s: _write_split(tmp, s, parts[s], version) for s in parts}
        kept = [c for s in parts for c in parts[s]]
        meta = _meta(info, vocab, version, splits, w.paths, kept, parts, w.drops, w.repeats, cfg)
        meta["chat"] = _chat_entry(
            template, cfg, parts, w.drops, w.truncated, w.base_vocab, w.base_sha or info["sha256"]
        )
        meta.update(extra or {})
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False), encoding="utf-8")
        write_marker(tmp, "data")
        replace_output(out, "data", force)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _template(tokenizer_spec: str, chat_template: str, convs, vocab_size: int):
    """(template, tokenizer kind, the base tokenizer's vocabulary, its sha256 or None): the HF tokenizer's own
    template (nothing added), or loom's with its chat tokens added to the base tokenizer."""
    if chat_template == "tokenizer":
        from loom.data.hf_chat import HFChatTemplate

        template = HFChatTemplate.from_folder(tokenizer_spec, convs)  # refuses a template without end-of-turn
        return template, "tokenizer.json", template.vocab_size, None  # the data's own: nothing added
    texts = ["\n".join(t for m in messages for t in message_texts(m)) for _, messages in convs]
    base, kind, base_sha = base_tokenizer(tokenizer_spec, texts, vocab_size)
    # the tool tokens only for data with tool calls: other chat data keeps the vocabulary it always had
    tools = any(m["role"] in ("tool", "tools") or m.get("tool_calls") for _, c in convs for m in c)
    return ChatTemplate(add_chat_tokens(base, tools=tools)), kind, base.vocab_size, base_sha


def _warn_dropped(template, drops: Drops, kept: list, truncated: int, block_size: int, paths) -> None:
    """Every dropped record counted by reason, the truncated ones; an error when none is left."""
    if not kept:
        _check_template_failed(template, drops)
    for line in drops.lines():
        log.warn(f"dropped {line}")
    if truncated:
        log.warn(f"truncated {truncated} conversation(s) to --block-size + 1 = {block_size + 1} tokens")
    if not kept:
        _all_dropped(paths, drops)


def _split_kept(kept: list, val_fraction: float, seed: int) -> tuple[dict, int]:
    """({train, val}: conversations, the number that repeat an earlier one)."""
    val_idx = set(_split(len(kept), val_fraction, seed).tolist())
    parts = {
        "train": [c for i, c in enumerate(kept) if i not in val_idx],
        "val": [c for i, c in enumerate(kept) if i in val_idx],
    }
    if not parts["val"]:
        log.warn("one conversation only: the val split is empty")
    repeats = len(kept) - len({hashlib.blake2b(c.ids.tobytes()).digest() for c in kept})
    if repeats:
        log.warn(f"{repeats} conversation(s) repeat an earlier one: a copy in val makes the val loss too low")
    return parts, repeats


def _meta(info, vocab, version, splits, paths, kept, parts, drops: Drops, repeats: int, cfg) -> dict:
    """meta.json but its chat entry."""
    return {
        "format": "llm.c",
        "tokenizer": info,
        "vocab_size": vocab,
        "shard_version": version,
        "splits": splits,
        "files": len(paths),
        "documents": len(kept),
        "bytes": sum(p.stat().st_size for p in paths),
        "dropped_documents": drops.total(),
        "bad_lines": sum(drops.counts.get(r, 0) for r in ("not JSON", "not UTF-8", "not a JSON object")),
        "repeated_documents": repeats,
        "val_fraction": cfg.val_fraction,
        "split_mode": "docs",
        "seed": cfg.seed,
        "bytes_per_token_val": sum(c.content_bytes for c in parts["val"])
        / max(1, sum(c.content_tokens for c in parts["val"])),
        "encoder": "char" if info["kind"] == "char" else "tokenizers",
        "source": ", ".join(str(p) for p in paths),
        "loom_version": __version__,
    }


def _chat_entry(
    template,
    cfg: ChatSettings,
    parts: dict,
    drops: Drops,
    truncated: int,
    base_vocab: int,
    base_sha: str,
) -> dict:
    """meta.json's "chat" entry: the template, what each split holds, what was dropped, the base tokenizer."""
    if isinstance(template, ChatTemplate):
        head = {"template": "loom", "tokens": dict(template.ids), "end_id": template.end_id}
    else:  # the tokenizer's: its Jinja text, special tokens, end-of-turn and separator (HFChatTemplate.from_meta)
        head = template.meta_entry()
    return {
        **head,
        "conversations": {s: len(parts[s]) for s in parts},
        "trained_tokens": {s: int(sum(int(c.mask.sum()) for c in parts[s])) for s in parts},
        "dropped": dict(drops.counts),
        "truncated": truncated,
        "too_long": cfg.too_long,
        "block_size": cfg.block_size,
        "base_vocab_size": base_vocab,
        "base_tokenizer": str(cfg.tokenizer),
        "base_tokenizer_hash": base_sha,  # what the run to fine-tune records: loom.train.finetune checks it
    }


def _report(out: Path, meta: dict, seconds: float) -> None:
    c, splits = meta["chat"], meta["splits"]
    if c["template"] == "tokenizer":
        added = f"the tokenizer's own chat template, end-of-turn {c['end_token']}"
        if c["prepended"]:
            sep = meta["tokenizer"]["eot_id"]
            added += f", each conversation after the separator id {sep} (prepended: the template writes none)"
    else:
        added = f"{c['base_vocab_size']:,} + {meta['vocab_size'] - c['base_vocab_size']} chat tokens"
    log.info(
        f"prepared {out}: {meta['documents']} conversation(s) (train {c['conversations']['train']}, val "
        f"{c['conversations']['val']}), {splits['train']['tokens']:,} + {splits['val']['tokens']:,} tokens, "
        f"{c['trained_tokens']['train']:,} + {c['trained_tokens']['val']:,} trained on, vocab "
        f"{meta['vocab_size']:,} ({added}), {sum(c['dropped'].values())} dropped, {c['truncated']} truncated, in {seconds:.1f}s"
    )


def _fresh_tmp(tmp: Path, force: bool) -> None:
    """An empty temporary folder beside the output; an unfinished `loom data prepare` there is refused
    unless --force (run its command again to finish it)."""
    if (tmp / "progress.json").is_file() and not force:
        raise LoomError(
            f"'{tmp}' holds an unfinished preparation",
            hint="run that preparation's command again to finish it, or pass --force to replace it",
        )
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _check_template_failed(template, drops: Drops) -> None:
    """No conversation rendered and the tokenizer's template raised errors: the template's fault (an
    undefined name, a failing filter) more likely than the records', so it is the one error, named once."""
    from loom.data.hf_chat import TEMPLATE_ERROR

    failed = {r: n for r, n in drops.counts.items() if r.startswith(TEMPLATE_ERROR)}
    if isinstance(template, ChatTemplate) or not failed:
        return
    reason = max(failed, key=failed.__getitem__)
    others = [line for line in drops.lines() if TEMPLATE_ERROR not in line]
    raise LoomError(
        f"{template.origin} failed on every conversation it was given ({sum(failed.values())}, none "
        f"rendered): {reason.removeprefix(TEMPLATE_ERROR)} (first at {drops.places[reason][0]})"
        + (f"; dropped besides: {'; '.join(others)}" if others else ""),
        hint="fix the template (it reads each message's role and content), or use --chat-template loom",
    )


def start_prepare(out, inputs, cfg: ChatSettings, force: bool) -> tuple[Path, list[Path], Drops]:
    """What every chat-data preparation (conversations, preference pairs) checks before reading a record: the
    inputs, the settings, the output apart from them and replaceable; the output's path, the inputs' and an
    empty drop count."""
    out = Path(out)
    paths = check_inputs(inputs)
    cfg.check()
    check_apart(out, paths)
    check_replaceable(out, "data", force)
    return out, paths, Drops()


def _all_dropped(paths: list[Path], drops: Drops) -> None:
    where = ", ".join(str(p) for p in paths)
    why = "; ".join(drops.lines()) or "no records"
    raise LoomError(
        f"no conversation to prepare in {where}: {why}",
        hint='each line: {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": '
        '"..."}]} or {"prompt": "...", "completion": "..."}; raise --block-size or pass --too-long truncate '
        "for long ones",
    )
