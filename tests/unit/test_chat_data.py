"""Chat data for SFT (loom.data.chat, loom.data.chat_prepare: `loom data prepare --chat`).

Compared against: ids written out by hand from the template's definition (nanochat's layout: end-of-text,
then START + content + END per message; the mask on the assistant's content and <|assistant_end|> only);
transformers' apply_chat_template with the template's Jinja text, tokenized by PreTrainedTokenizerFast (must
equal prompt()); the `tokenizers` library's own ids for the base tokenizer (unchanged after the chat tokens
are added); and the written shards and masks read back through loom.data.formats.open_split.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from loom.cli import main
from loom.data.chat import (
    ASSISTANT_END,
    ASSISTANT_START,
    CHAT_TOKENS,
    SYSTEM_END,
    SYSTEM_START,
    USER_END,
    USER_START,
    ChatTemplate,
    add_chat_tokens,
)
from loom.data.chat_prepare import prepare_chat
from loom.data.messages import Drops, read_conversations
from loom.data.tokenizers import (
    EOT,
    CharTokenizer,
    HFTokenizer,
    load_tokenizer,
    tokenizer_hash,
)
from loom.errors import LoomError

CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hey"},
    {"role": "user", "content": "bye?"},
    {"role": "assistant", "content": "by"},
]
TEXTS = ["be brief hi hey bye? by", "hello there, how are you today? fine thanks"]


def char_template() -> ChatTemplate:
    return ChatTemplate(add_chat_tokens(CharTokenizer.train(TEXTS)))


def bpe_tokenizer() -> HFTokenizer:
    return HFTokenizer.train(TEXTS * 20, 300, trainer="tokenizers")  # the library's trainer: ~0.05 s


def write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def conv(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


# --- the template ----------------------------------------------------------------------------------------


def test_render_exact_ids_and_mask_char():
    t = char_template()
    tok = t.tok
    n = len(tok.chars)
    assert tok.eot_id == n and [t.ids[s] for s in CHAT_TOKENS] == list(range(n + 1, n + 7))
    assert tok.vocab_size == n + 7 and t.end_id == n + 6 and t.stop_ids == (n + 6, n)
    ids, mask = t.render(CONV[:3])
    e = tok.encode
    s = t.ids
    want = [n, s[SYSTEM_START], *e("be brief"), s[SYSTEM_END], s[USER_START], *e("hi"), s[USER_END]] + [
        s[ASSISTANT_START],
        *e("hey"),
        s[ASSISTANT_END],
    ]
    assert ids == want
    assert mask == [0] * (len(want) - 4) + [1, 1, 1, 1]  # "hey" and <|assistant_end|>
    assert tok.decode(ids) == "\n" + "".join(
        [
            SYSTEM_START,
            "be brief",
            SYSTEM_END,
            USER_START,
            "hi",
            USER_END,
            ASSISTANT_START,
            "hey",
            ASSISTANT_END,
        ]
    )


def test_multi_turn_mask_only_on_assistant_answers():
    t = char_template()
    ids, mask = t.render(CONV)
    assert len(ids) == len(mask)
    # the rendering is the concatenation of the turns, each START + content + END
    pieces = [t.tok.eot_id]
    for m in CONV:
        start, end = {"system": (SYSTEM_START, SYSTEM_END), "user": (USER_START, USER_END)}.get(
            m["role"], (ASSISTANT_START, ASSISTANT_END)
        )
        pieces += [t.ids[start], *t.tok.encode(m["content"]), t.ids[end]]
    assert ids == pieces
    trained = t.tok.decode([i for i, k in zip(ids, mask, strict=True) if k])
    assert trained == "hey" + ASSISTANT_END + "by" + ASSISTANT_END
    never = {t.tok.eot_id, *(t.ids[x] for x in CHAT_TOKENS if x != ASSISTANT_END)}
    assert all(k == 0 for i, k in zip(ids, mask, strict=True) if i in never)
    # every user / system content token is untrained: mask is 0 from each START to its END
    inside = False
    for i, k in zip(ids, mask, strict=True):
        if i in (t.ids[USER_START], t.ids[SYSTEM_START]):
            inside = True
        if inside:
            assert k == 0
        if i in (t.ids[USER_END], t.ids[SYSTEM_END]):
            inside = False


def test_prompt_is_the_prefix_up_to_the_last_assistant_start():
    t = char_template()
    ids, _ = t.render(CONV)
    cut = len(ids) - 1 - ids[::-1].index(t.ids[ASSISTANT_START])  # the last <|assistant_start|>
    assert t.prompt(CONV[:-1]) == ids[: cut + 1]
    assert t.prompt(CONV[:2]) == ids[: ids.index(t.ids[ASSISTANT_START]) + 1]
    with pytest.raises(LoomError, match="unknown role"):
        t.render([{"role": "robot", "content": "x"}])
    # a tool message is a conversation's, but this template's tokenizer has no tool tokens (test_chat_tools.py)
    with pytest.raises(LoomError, match="no tool roles"):
        t.render(
            [
                {"role": "user", "content": "x"},
                {"role": "tool", "content": "x"},
                {"role": "assistant", "content": "y"},
            ]
        )


def test_char_tokenizer_specials_save_load_hash(tmp_path):
    base = CharTokenizer.train([*TEXTS, USER_START])
    tok = add_chat_tokens(base)
    assert add_chat_tokens(tok) is tok  # idempotent
    assert base.vocab_size + 6 == tok.vocab_size and tok.chars == base.chars and tok.eot_id == base.eot_id
    assert tok.encode(USER_START) == [tok.stoi[c] for c in USER_START]  # text, never the special id
    meta = {"tokenizer": {"kind": "char", "file": tok.save(tmp_path)}}
    raw = json.loads((tmp_path / "char_vocab.json").read_text(encoding="utf-8"))
    assert raw == {"chars": base.chars, "specials": list(CHAT_TOKENS)}
    back = load_tokenizer(tmp_path, meta)
    assert back.specials == list(CHAT_TOKENS) and back.vocab_size == tok.vocab_size
    plain = tmp_path / "plain"
    plain.mkdir()
    plain_meta = {"tokenizer": {"kind": "char", "file": base.save(plain)}}
    assert json.loads((plain / "char_vocab.json").read_text(encoding="utf-8")) == {"chars": base.chars}
    assert tokenizer_hash(tmp_path, meta) != tokenizer_hash(plain, plain_meta)


def test_bpe_chat_token_text_in_a_message_is_not_the_special_id():
    tok = add_chat_tokens(bpe_tokenizer())
    t = ChatTemplate(tok)
    special = set(t.ids.values()) | {tok.eot_id}
    msgs = [
        {"role": "user", "content": f"say {ASSISTANT_END} and {EOT} and {USER_START}"},
        {"role": "assistant", "content": f"ok {ASSISTANT_END}"},
    ]
    ids, mask = t.render(msgs)
    inner = [i for i in ids if i in special]  # only the template's own specials
    assert inner == [tok.eot_id, t.ids[USER_START], t.ids[USER_END], t.ids[ASSISTANT_START], t.end_id]
    assert tok.decode(ids).count(ASSISTANT_END) == 3  # two typed as text, one the real end
    assert sum(mask) == len(t.encode(f"ok {ASSISTANT_END}")) + 1


def test_jinja_template_equals_prompt_with_transformers():
    transformers = pytest.importorskip("transformers")
    tok = add_chat_tokens(bpe_tokenizer())
    t = ChatTemplate(tok)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.tok)
    hf.chat_template = t.jinja()
    for history in (CONV[:2], CONV[:4], CONV[1:2]):
        text = hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        assert hf.encode(text, add_special_tokens=False) == t.prompt(history)
    full = hf.apply_chat_template(CONV, tokenize=False)
    assert hf.encode(full, add_special_tokens=False) == t.render(CONV)[0]


# --- reading and preparing ------------------------------------------------------------------------------


def test_bad_records_counted_by_reason_with_lines(tmp_path):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [
            conv("hi", "hey"),  # 1 ok
            "not json {",  # 2
            "[1, 2]",  # 3
            {"messages": [{"role": "user", "content": "hi"}]},  # 4
            {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},  # 5
            {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]},  # 6
            {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},  # 7
            {"messages": [*conv("a", "b")["messages"], {"role": "system", "content": "s"}]},  # 8
            "",  # 9: blank, not a record
            {"prompt": "2+2?", "completion": "4"},  # 10 ok
            {"text": "plain"},  # 11
            {"messages": [{"role": "user", "content": "a"}]},  # 12
        ],
    )
    drops = Drops()
    found = read_conversations([path], drops)
    assert [w for w, _ in found] == ["c.jsonl:1", "c.jsonl:10"]
    assert found[1][1] == conv("2+2?", "4")["messages"]
    assert drops.counts == {
        "not JSON": 1,
        "not a JSON object": 1,
        "no assistant turn": 2,
        "unknown role": 1,
        "empty content": 1,
        "content is not a string": 1,
        "system message not first": 1,
        "no messages (nor prompt and completion)": 1,
    }
    assert drops.places["no assistant turn"] == ["c.jsonl:4", "c.jsonl:12"]
    assert "2 record(s): no assistant turn (c.jsonl:4, c.jsonl:12)" in drops.lines()
    meta = prepare_chat([path], tmp_path / "out", "char", block_size=64)
    assert meta["chat"]["dropped"] == drops.counts and meta["dropped_documents"] == 9
    assert meta["chat"]["conversations"] == {"train": 1, "val": 1}


def test_compressed_and_parquet_conversations_read_as_jsonl(tmp_path):
    """.jsonl.gz, .jsonl.zst and Parquet hold the same records as the plain file (they were read as raw bytes,
    every line "not UTF-8")."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = [{"messages": CONV}, conv("hi", "hey"), {"messages": [{"role": "user", "content": "a"}]}]
    plain = write_jsonl(tmp_path / "c.jsonl", records)
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    zst = tmp_path / "c.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    parquet = tmp_path / "c.parquet"
    messages = [r["messages"] for r in records]
    pq.write_table(pa.table({"messages": messages, "id": [1, 2, 3]}), parquet, row_group_size=2)
    want = [CONV, conv("hi", "hey")["messages"]]
    for path in (plain, gz, zst):
        drops = Drops()
        found = read_conversations([path], drops)
        assert [m for _, m in found] == want and [w for w, _ in found] == [f"{path.name}:1", f"{path.name}:2"]
        assert drops.places == {"no assistant turn": [f"{path.name}:3"]}
    drops = Drops()
    found = read_conversations([parquet], drops)
    assert [m for _, m in found] == want and [w for w, _ in found] == ["c.parquet row 0", "c.parquet row 1"]
    assert drops.places == {"no assistant turn": ["c.parquet row 2"]}
    pairs = tmp_path / "pairs.parquet"  # prompt and completion columns
    pq.write_table(pa.table({"prompt": ["hi"], "completion": ["hey"]}), pairs)
    assert read_conversations([pairs], Drops()) == [("pairs.parquet row 0", conv("hi", "hey")["messages"])]
    other = tmp_path / "text.parquet"
    pq.write_table(pa.table({"text": ["plain"]}), other)
    with pytest.raises(LoomError, match="'.*text.parquet' has no column messages .*columns are text"):
        read_conversations([other], Drops())


def test_a_plain_or_broken_compressed_file_is_refused_by_name(tmp_path, capsys):
    """A .jsonl.gz that is plain JSONL, and one cut short: one error naming the file (it was a traceback)."""
    import gzip

    body = "\n".join(json.dumps(conv(f"q{i}", f"a{i}")) for i in range(400)) + "\n"
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_text(body, encoding="utf-8")
    out = tmp_path / "out"
    argv = ["data", "prepare", "--chat", "--out", str(out), "--block-size", "64", "--input"]
    assert main([*argv, str(plain)]) == 2
    err = capsys.readouterr().err
    assert f"'{plain}' is not gzip-compressed" in err and "Traceback" not in err
    cut = tmp_path / "cut.jsonl.gz"
    whole = gzip.compress(body.encode())
    cut.write_bytes(whole[: len(whole) // 2])
    assert main([*argv, str(cut)]) == 2
    assert f"'{cut}' is corrupt after line" in capsys.readouterr().err
    assert not out.exists()


def test_too_long_drop_vs_truncate_and_all_dropped(tmp_path):
    short, long_ = conv("hi", "ok"), conv("hi", "a long answer " * 5)  # 9 and 77 tokens (eot + 4 + content)
    path = write_jsonl(tmp_path / "c.jsonl", [short, long_, short, {"prompt": "x" * 30, "completion": "y"}])
    dropped = prepare_chat([path], tmp_path / "drop", "char", block_size=20)
    c = dropped["chat"]
    assert c["dropped"] == {"longer than --block-size + 1 = 21 tokens": 2} and c["truncated"] == 0
    assert c["conversations"]["train"] + c["conversations"]["val"] == 2
    cut = prepare_chat([path], tmp_path / "cut", "char", block_size=20, too_long="truncate")
    c = cut["chat"]
    # the long answer keeps 21 tokens; the long prompt has no trained token within 21 and is dropped
    assert c["truncated"] == 1 and c["dropped"] == {"no trained token in the first 21 tokens (truncated)": 1}
    assert cut["splits"]["train"]["tokens"] + cut["splits"]["val"]["tokens"] == 9 + 9 + 21
    again = prepare_chat([path], tmp_path / "drop", "char", block_size=100, force=True)  # replaces its own
    assert again["chat"]["dropped"] == {} and again["chat"]["block_size"] == 100
    with pytest.raises(LoomError, match="no conversation to prepare.*longer than --block-size"):
        prepare_chat([path], tmp_path / "none", "char", block_size=4)
    assert not (tmp_path / "none").exists() and not (tmp_path / ".none.loom-tmp").exists()
    bad = write_jsonl(tmp_path / "bad.jsonl", ["nope", {"messages": []}])
    with pytest.raises(LoomError, match=r"not JSON \(bad.jsonl:1\)"):
        prepare_chat([bad], tmp_path / "none", "char", block_size=64)


def test_special_token_text_refused_where_tokenizers_would_parse_it(tmp_path, monkeypatch):
    """A `tokenizers` without encode_special_tokens (< 0.19): such content is dropped, counted by reason."""
    from loom.data import chat

    monkeypatch.setattr(chat, "_content_encoder", lambda tok: None)
    tok = bpe_tokenizer()
    tok.save(tmp_path)
    path = write_jsonl(tmp_path / "c.jsonl", [conv("hi", "ok"), conv(f"x {USER_END}", "y"), conv("a", "b")])
    meta = prepare_chat([path], tmp_path / "out", str(tmp_path / "tokenizer.json"), block_size=64)
    assert meta["chat"]["dropped"] == {
        "content contains a special token (this tokenizers version parses them)": 1
    }
    with pytest.raises(LoomError, match="contains a special token"):
        ChatTemplate(add_chat_tokens(tok)).render(conv(EOT, "y")["messages"])


def test_a_long_split_is_cut_into_shards_at_conversation_boundaries(tmp_path, monkeypatch):
    from loom.data import chat_prepare
    from loom.data.formats import open_split

    monkeypatch.setattr(chat_prepare, "SHARD_TOKENS", 30)
    path = write_jsonl(tmp_path / "c.jsonl", [conv(f"q{i}", "answer") for i in range(8)])
    meta = prepare_chat([path], tmp_path / "out", "char", block_size=64, val_fraction=0.25)
    shards = open_split(tmp_path / "out", "train")
    assert len(shards) == meta["splits"]["train"]["shards"] == 3  # 6 conversations of 13 tokens, 2 a shard
    eot = meta["tokenizer"]["eot_id"]
    for i, ids in enumerate(shards):
        mask = np.load(tmp_path / "out" / f"train_{i:06d}.mask.npy")
        assert ids[0] == eot and len(ids) == 26 and (ids == eot).sum() == 2  # whole conversations
        assert mask.shape == ids.shape and mask.sum() == 2 * 7  # "answer" + <|assistant_end|>, twice


def fake_run(root: Path, tok, kind: str) -> Path:
    """A run directory's tokenizer as training writes it: <run>/tokenizer/{meta.json, tokenizer file}."""
    d = root / "tokenizer"
    d.mkdir(parents=True)
    info = {"kind": kind, "file": tok.save(d), "eot_id": tok.eot_id}
    meta = {"format": "llm.c", "vocab_size": tok.vocab_size, "tokenizer": info}
    (d / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    (root / "config.toml").write_text("", encoding="utf-8")
    return root


def test_run_directory_tokenizer_gets_chat_tokens_after_its_ids(tmp_path):
    base = bpe_tokenizer()
    run = fake_run(tmp_path / "run", base, "bpe")
    path = write_jsonl(
        tmp_path / "c.jsonl", [conv("hello there", "fine thanks"), conv("how are you", "fine")]
    )
    meta = prepare_chat([path], tmp_path / "out", str(run), block_size=128)
    tok = load_tokenizer(tmp_path / "out", meta)
    assert tok.vocab_size == base.vocab_size + 6 == meta["vocab_size"]
    assert meta["chat"]["tokens"] == {t: base.vocab_size + i for i, t in enumerate(CHAT_TOKENS)}
    assert meta["chat"]["base_vocab_size"] == base.vocab_size and meta["chat"]["base_tokenizer"] == str(run)
    run_meta = json.loads((run / "tokenizer" / "meta.json").read_text(encoding="utf-8"))
    assert meta["chat"]["base_tokenizer_hash"] == tokenizer_hash(run / "tokenizer", run_meta)
    old, new = base.tok.get_vocab(with_added_tokens=True), tok.tok.get_vocab(with_added_tokens=True)
    assert all(new[k] == v for k, v in old.items())  # every id the run learned keeps its meaning
    assert tok.encode(TEXTS[1]) == base.encode(TEXTS[1]) and tok.eot_id == base.eot_id
    # a char run: characters and end-of-text keep their ids, the chat tokens follow
    cbase = CharTokenizer.train(TEXTS)
    crun = fake_run(tmp_path / "crun", cbase, "char")
    cmeta = prepare_chat([path], tmp_path / "cout", str(crun), block_size=128)
    ctok = load_tokenizer(tmp_path / "cout", cmeta)
    assert ctok.chars == cbase.chars and ctok.eot_id == cbase.eot_id and ctok.specials == list(CHAT_TOKENS)


def test_block_size_is_taken_from_the_run_to_fine_tune(tmp_path, capsys):
    """--tokenizer RUN: the run's config.toml has the context length, so --block-size may be left out."""
    run = fake_run(tmp_path / "run", CharTokenizer.train(TEXTS), "char")
    (run / "config.toml").write_text("[model]\nblock_size = 24\n", encoding="utf-8")
    path = write_jsonl(
        tmp_path / "c.jsonl", [conv("hello there", "fine thanks"), conv("how are you", "fine")]
    )
    out = tmp_path / "out"
    assert (
        main(["data", "prepare", "--chat", "--input", str(path), "--out", str(out), "--tokenizer", str(run)])
        == 0
    )
    assert f"--block-size 24: the model.block_size of run '{run}'" in capsys.readouterr().out
    assert json.loads((out / "meta.json").read_text(encoding="utf-8"))["chat"]["block_size"] == 24


def test_a_character_outside_a_char_vocabulary_is_named_with_its_line(tmp_path, capsys):
    run = fake_run(tmp_path / "run", CharTokenizer.train(TEXTS), "char")
    records = [conv("hello there", "fine"), conv("héllo", "fine"), conv("how are you", "fi\u200bne")]
    path = write_jsonl(tmp_path / "c.jsonl", [*records, conv("how are you", "fine thanks")])
    argv = ["data", "prepare", "--chat", "--input", str(path), "--out", str(tmp_path / "out")]
    assert main([*argv, "--tokenizer", str(run), "--block-size", "64"]) == 0
    assert (
        "dropped 2 record(s): a character not in the tokenizer's vocabulary (c.jsonl:2 'é' U+00E9, "
        "c.jsonl:3 '\\u200b' U+200B)" in capsys.readouterr().out
    )


def test_cli_end_to_end_shards_masks_meta(tmp_path, capsys):
    from loom.data.formats import open_split

    records = [conv(f"question {i}", f"answer {i} " * (i % 3 + 1)) for i in range(10)]
    records.insert(3, {"prompt": "2+2?", "completion": "4"})
    records.append("broken")
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    out = tmp_path / "out"
    argv = ["data", "prepare", "--chat", "--input", str(path), "--out", str(out), "--tokenizer", "bpe"]
    assert main([*argv, "--block-size", "256", "--vocab-size", "300", "--val-fraction", "0.2"]) == 0
    assert "dropped 1 record(s): not JSON (chats.jsonl:12)" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        ".loom-output",
        "meta.json",
        "tokenizer.json",
        "train_000000.bin",
        "train_000000.mask.npy",
        "val_000000.bin",
        "val_000000.mask.npy",
    ]
    assert meta["chat"]["conversations"] == {"train": 9, "val": 2} and meta["tokenizer"]["kind"] == "bpe"
    tok = load_tokenizer(out, meta)
    t = ChatTemplate(tok)
    assert meta["chat"]["tokens"] == t.ids and meta["chat"]["end_id"] == t.end_id
    convs = [
        r["messages"] if "messages" in r else conv(r["prompt"], r["completion"])["messages"]
        for r in records[:-1]
    ]
    every = [t.render(m) for m in convs]
    seen = {}
    for split in ("train", "val"):
        (ids,) = open_split(out, split)
        mask = np.load(out / f"{split}_000000.mask.npy", allow_pickle=False)
        assert mask.dtype == np.uint8 and mask.shape == ids.shape == (meta["splits"][split]["tokens"],)
        assert int(mask.sum()) == meta["chat"]["trained_tokens"][split]
        # whole conversations in input order, each exactly as render writes it (ids and mask)
        starts = [*np.flatnonzero(np.asarray(ids) == tok.eot_id).tolist(), len(ids)]
        assert starts[0] == 0 and len(starts) - 1 == meta["chat"]["conversations"][split]
        got = [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in pairwise(starts)]
        order = [every.index(g) for g in got]
        assert order == sorted(order)
        seen[split] = order
    assert sorted(seen["train"] + seen["val"]) == list(range(len(every)))  # each once, train or val
    # each split is the rendered ids of its conversations concatenated
    for split, order in seen.items():
        assert np.array_equal(open_split(out, split)[0], np.concatenate([every[i][0] for i in order]))


def test_cli_refusals_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    good = write_jsonl(tmp_path / "c.jsonl", [conv("hi", "ok")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    base = ["data", "prepare", "--chat", "--out", str(out)]
    cases = [
        ([*base, "--input", str(tmp_path / "missing.jsonl"), "--block-size", "8"], "does not exist"),
        ([*base, "--input", str(empty), "--block-size", "8"], "is empty"),
        ([*base, "--input", str(good)], "--chat needs --block-size"),
        (
            [*base, "--input", str(good), "--block-size", "8", "--tokenizer", "nope.json"],
            "'nope.json' does not exist",
        ),
        (
            ["data", "prepare", "--input", str(good), "--out", str(out), "--block-size", "8"],
            "options of --chat",
        ),
        # options of plain-text preparation (they were ignored without a word), even at their default value
        (
            [*base, "--input", str(good), "--block-size", "8", "--split-mode", "tail", "--jsonl-field=text"],
            "--split-mode, --jsonl-field are options of plain-text preparation, which --chat does not read",
        ),
        ([*base, "--input", str(good), "--glob", "*.jsonl"], "--glob is an option of plain-text preparation"),
        ([*base, "--input", str(good), "--strict", "--block-size", "8"], "--strict is an option of"),
        # preference pairs share these checks, named as the user gave them
        (
            ["data", "prepare", "--pairs", "--out", str(out), "--input", str(good)],
            "--pairs needs --block-size",
        ),
        (
            ["data", "prepare", "--pairs", "--out", str(out), "--input", str(good), "--glob", "*.jsonl"],
            "which --pairs does not read\n  hint: leave out --glob: --pairs reads each --input file as preference pairs",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()
    out.mkdir()
    (out / "x").write_text("keep", encoding="utf-8")
    assert main([*base, "--input", str(good), "--block-size", "8"]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--chat", "--pairs"])
def test_a_missing_tokenizer_is_named_before_the_block_size(tmp_path, capsys, flag):
    """`--tokenizer runs/missing` (a run folder that is not there): the error names the missing path and what
    --tokenizer takes, not --block-size (which a run would have given), and nothing is written."""
    out, missing = tmp_path / "out", tmp_path / "runs" / "missing"
    good = write_jsonl(tmp_path / "c.jsonl", [conv("hi", "ok")])
    base = ["data", "prepare", flag, "--input", str(good), "--out", str(out), "--tokenizer", str(missing)]
    for extra in ([], ["--block-size", "8"]):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert f"--tokenizer '{missing}' does not exist" in err, err
        assert "a run folder" in err and "char" in err and "bpe" in err, err
        assert "--block-size" not in err, err
        assert not out.exists()


# --- the tokenizer's own chat template (--chat-template tokenizer, loom.data.hf_chat) --------------------

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# Llama 3's template, small: bos, then per message a header, the trimmed content and <|eot_id|>
LLAMA3_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim }}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen's (ChatML): no bos, the same token starts every turn, a newline after <|im_end|>
CHATML_JINJA = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('no system messages') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NO_END_JINJA = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def hf_tokenizer_folder(path: Path, specials: list[str], jinja: str | None, **tokens) -> Path:
    """A tiny HF tokenizer folder as save_pretrained writes one: a byte-level BPE trained here with `specials`
    first, and a tokenizer_config.json with the chat template and the named special tokens (bos/eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 20, trainer=trainer)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokens}
    if jinja is not None:
        config["chat_template"] = jinja
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def hf_ids(hf, messages: list[dict], generation: bool = False) -> list[int]:
    """transformers' apply_chat_template ids (a list in 4.x, a BatchEncoding in 5.x)."""
    out = hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def test_tokenizer_template_masks_answers_and_eot_llama3(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from loom.data.chat import chat_template_of
    from loom.data.formats import open_split
    from loom.data.hf_chat import HFChatTemplate

    folder = hf_tokenizer_folder(
        tmp_path / "tok",
        LLAMA3_SPECIALS,
        LLAMA3_JINJA,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    vocab = hf.convert_tokens_to_ids
    records = [{"messages": CONV}, conv("hello there", "fine thanks"), conv("how are you", "fine today")]
    records.append(conv("say <|eot_id|>", "no"))  # would be the special token once rendered: dropped
    path = write_jsonl(tmp_path / "c.jsonl", records)
    out = tmp_path / "out"
    argv = ["data", "prepare", "--chat", "--input", str(path), "--out", str(out), "--tokenizer", str(folder)]
    assert main([*argv, "--chat-template", "tokenizer", "--block-size", "128", "--val-fraction", "0.3"]) == 0
    assert "end-of-turn <|eot_id|>" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    c = meta["chat"]
    assert c["template"] == "tokenizer" and c["jinja"] == LLAMA3_JINJA and c["prepended"] is False
    assert c["end_id"] == vocab("<|eot_id|>") and c["end_token"] == "<|eot_id|>"
    assert c["special_tokens"] == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert c["stop_ids"] == [vocab("<|eot_id|>"), vocab("<|end_of_text|>")]
    assert c["dropped"] == {"content contains the text of a special token of the tokenizer": 1}
    assert meta["tokenizer"]["eot_id"] == vocab("<|begin_of_text|>")  # conversations start with bos
    assert meta["vocab_size"] == c["base_vocab_size"] == len(hf)  # nothing added
    assert c["base_tokenizer_hash"] == meta["tokenizer"]["sha256"]

    bos, special = vocab("<|begin_of_text|>"), {vocab(t) for t in LLAMA3_SPECIALS}
    convs = [r["messages"] for r in records[:3]]
    want = {tuple(hf_ids(hf, m)): m for m in convs}  # transformers' own rendering of each conversation
    seen = 0
    for split in ("train", "val"):
        (ids,) = open_split(out, split)
        mask = np.load(out / f"{split}_000000.mask.npy")
        starts = [*np.flatnonzero(np.asarray(ids) == bos).tolist(), len(ids)]
        for a, b in pairwise(starts):
            one, m = ids[a:b].tolist(), mask[a:b].tolist()
            messages = want[tuple(one)]
            seen += 1
            # trained: each answer as the template writes it, then <|eot_id|>; nothing else
            runs, cur = [], []
            for i, k in zip(one, m, strict=True):
                if k:
                    cur.append(i)
                elif cur:
                    runs.append(cur)
                    cur = []
            runs += [cur] if cur else []
            answers = [x["content"] for x in messages if x["role"] == "assistant"]
            assert [hf.decode(r) for r in runs] == [a + "<|eot_id|>" for a in answers]
            assert all(k == 0 for i, k in zip(one, m, strict=True) if i in special - {c["end_id"]})
            header = vocab("<|start_header_id|>"), vocab("<|end_header_id|>")
            inside = False
            for i, k in zip(one, m, strict=True):  # every header (<|start_header_id|>role<|end_header_id|>)
                inside = (inside or i == header[0]) and i != header[1]
                assert not (inside and k)
    assert seen == 3

    tok = load_tokenizer(out, meta)
    t = chat_template_of(tok, meta)
    assert isinstance(t, HFChatTemplate) and t.end_id == c["end_id"] and t.eot_id == bos
    for history in (CONV[:2], CONV[:4], CONV[1:2]):
        assert t.prompt(history) == hf_ids(hf, history, generation=True)
    assert t.render(CONV)[0] == hf_ids(hf, CONV)
    # the export's template (tokenizer_config.json of `loom export`, whose bos is another token) gives the same
    bare = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok.tok, chat_template=t.jinja(), bos_token="<|end_of_text|>"
    )
    text = bare.apply_chat_template(CONV[:4], tokenize=False, add_generation_prompt=True)
    assert bare.encode(text, add_special_tokens=False) == t.prompt(CONV[:4])
    assert list(t.ids) == ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    with pytest.raises(LoomError, match="special token"):
        t.prompt([{"role": "user", "content": "hi <|eot_id|>"}])


def test_tokenizer_template_without_bos_gets_a_separator_chatml(tmp_path):
    pytest.importorskip("transformers")
    from loom.data.formats import open_split

    folder = hf_tokenizer_folder(tmp_path / "tok", CHATML_SPECIALS, CHATML_JINJA, eos_token="<|im_end|>")
    records = [conv("hello there", "fine thanks"), conv("how are you", "fine")]
    records.append({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]})
    records.append({"messages": CONV})  # the template refuses system messages
    path = write_jsonl(tmp_path / "c.jsonl", records)
    meta = prepare_chat([path], tmp_path / "out", str(folder), block_size=128, chat_template="tokenizer")
    tok = load_tokenizer(tmp_path / "out", meta)
    c = meta["chat"]
    sep, end = tok.token_id("<|endoftext|>"), tok.token_id("<|im_end|>")
    assert c["prepended"] is True and meta["tokenizer"]["eot_id"] == sep  # <|im_start|> begins every turn
    assert c["end_id"] == end and c["stop_ids"] == [end]
    assert c["dropped"] == {
        "the assistant speaks first (the template cannot render the empty history before it)": 1,
        "the chat template raised an error: no system messages": 1,
    }
    ids = np.concatenate([open_split(tmp_path / "out", s)[0] for s in ("train", "val")])
    mask = np.concatenate([np.load(tmp_path / "out" / f"{s}_000000.mask.npy") for s in ("train", "val")])
    assert ids[0] == sep and (ids == sep).sum() == 2
    text = tok.decode([i for i, k in zip(ids.tolist(), mask.tolist(), strict=True) if k])
    assert sorted(text.split("<|im_end|>")) == ["", "fine", "fine thanks"]  # not the "\n" after <|im_end|>
    from loom.data.chat import chat_template_of

    t = chat_template_of(tok, meta)
    assert t.prompt(CONV[1:2])[0] == sep and tok.decode(t.prompt(CONV[1:2])[1:]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenizer_template_refusals(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = write_jsonl(tmp_path / "c.jsonl", [conv("hi", "hello"), conv("a", "b")])
    out = tmp_path / "out"
    # a template that loses the end-of-turn token: refused before anything is written
    folder = hf_tokenizer_folder(
        tmp_path / "noend", LLAMA3_SPECIALS, NO_END_JINJA, bos_token="<|begin_of_text|>"
    )
    with pytest.raises(LoomError, match="loses the end-of-turn token"):
        prepare_chat([path], out, str(folder), block_size=64, chat_template="tokenizer")
    assert not out.exists() and not (tmp_path / ".out.loom-tmp").exists()
    none = hf_tokenizer_folder(tmp_path / "none", LLAMA3_SPECIALS, None)
    base = ["data", "prepare", "--chat", "--input", str(path), "--out", str(out), "--block-size", "64"]
    cases = [
        (["--tokenizer", "char"], "has none"),
        (["--tokenizer", "bpe"], "has none"),
        (["--tokenizer", str(none)], 'no "chat_template"'),
        (["--tokenizer", str(tmp_path / "missing")], "not a folder holding an HF tokenizer"),
        (["--tokenizer", str(tmp_path / "c.jsonl")], "not a folder holding an HF tokenizer"),
    ]
    for extra, message in cases:
        assert main([*base, *extra, "--chat-template", "tokenizer"]) == 2
        assert message in capsys.readouterr().err
        assert not out.exists()
    no_config = tmp_path / "only_json"
    no_config.mkdir()
    (folder / "tokenizer.json").rename(no_config / "tokenizer.json")
    assert main([*base, "--tokenizer", str(no_config), "--chat-template", "tokenizer"]) == 2
    assert "has no tokenizer_config.json" in capsys.readouterr().err
    # a template whose generation prompt is not how it writes the assistant's turn: every record dropped
    odd = CHATML_JINJA.replace("'<|im_start|>assistant\\n'", "'<|im_start|>model\\n'")
    assert odd != CHATML_JINJA
    folder = hf_tokenizer_folder(tmp_path / "odd", CHATML_SPECIALS, odd, eos_token="<|im_end|>")
    with pytest.raises(LoomError, match="no conversation to prepare.*generation prompt is not the start"):
        prepare_chat([path], out, str(folder), block_size=64, chat_template="tokenizer")
    assert not out.exists()
    plain = ["data", "prepare", "--input", str(path), "--out", str(out), "--chat-template", "tokenizer"]
    assert main(plain) == 2 and "options of --chat" in capsys.readouterr().err


def test_a_broken_tokenizer_template_is_one_error_naming_it(tmp_path, capsys):
    """A Jinja error of the template itself (it was every record dropped, with a hint about the JSON layout):
    one error naming the template, said once."""
    pytest.importorskip("transformers")
    path = write_jsonl(tmp_path / "c.jsonl", [conv(f"q{i}", f"a{i}") for i in range(40)])
    out = tmp_path / "out"
    base = ["data", "prepare", "--chat", "--input", str(path), "--out", str(out), "--block-size", "64"]
    cases = {
        "syntax": (LLAMA3_JINJA.replace("{% endfor %}", "{% endfo %}"), "is not a valid Jinja template: "),
        "filter": (LLAMA3_JINJA.replace("| trim", "| trimx"), "No filter named 'trimx'"),
        "undefined": (
            LLAMA3_JINJA.replace("message['content']", "message.meta.text"),
            "failed on every conversation it was given (40, none rendered): 'dict object' has no attribute "
            "'meta' (first at c.jsonl:1)",
        ),
    }
    for name, (jinja, message) in cases.items():
        folder = hf_tokenizer_folder(tmp_path / name, LLAMA3_SPECIALS, jinja, bos_token="<|begin_of_text|>")
        assert main([*base, "--tokenizer", str(folder), "--chat-template", "tokenizer"]) == 2
        out_text, err = capsys.readouterr()
        assert f"the \"chat_template\" of '{folder / 'tokenizer_config.json'}'" in err and message in err, err
        assert "dropped" not in out_text + err and '"messages"' not in err  # once, without the layout hint
        assert not out.exists()
    # a chat_template.jinja beside the config is the one transformers reads: the one named
    (folder / "chat_template.jinja").write_text(cases["syntax"][0], encoding="utf-8")
    assert main([*base, "--tokenizer", str(folder), "--chat-template", "tokenizer"]) == 2
    assert f"'{folder / 'chat_template.jinja'}' is not a valid Jinja template" in capsys.readouterr().err


def test_missing_transformers_names_the_extra(monkeypatch):
    import builtins

    from loom.data.hf_chat import import_transformers

    real = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(LoomError, match="not installed") as e:
        import_transformers()
    assert "loom[hf]" in e.value.hint
