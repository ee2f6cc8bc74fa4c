"""Tokenizer files of other libraries as --tokenizer, and `loom data tokenizer convert`. Compared against the
libraries themselves: a sentencepiece model (BPE and unigram) and a tiktoken file made here (no download) give
the ids `sentencepiece` and `tiktoken` give on a held-out text with code, Unicode and the end-of-text marker;
`loom data prepare` writes those ids; each conversion (tiktoken, tokenizer.json, gpt2's files) loads back to
the same ids."""

from __future__ import annotations

import base64
import io
import json
import random

import numpy as np
import pytest

from loom.cli import main
from loom.cli.data import data
from loom.data.encode import GPT2_PATTERN, GPT4_PATTERN
from loom.data.formats import open_split
from loom.data.prepare import prepare
from loom.data.tokenizers import convert_tokenizer, load_given_tokenizer, load_tokenizer
from loom.errors import LoomError

spm = pytest.importorskip("sentencepiece", reason="the data extra: pip install 'loom[data]'")
tiktoken = pytest.importorskip("tiktoken", reason="the data extra: pip install 'loom[data]'")

EOT = "<|endoftext|>"
WORDS = (
    "the quick brown fox jumps over lazy dog def return import numpy café naïve 日本語 Привет мир 🙂 "
    "x = [i*i for i in range(10)] if else: print(f'{x}')"
).split()
# not in the training text: tabs, indentation, new words, an emoji and Cyrillic punctuation, two markers
HELD_OUT = (
    "def square(x):\n    return x ** 2  # café 日本語 🙂\n"
    + EOT
    + "Привет, мир! naïve\tfox 😀 {k: v}\n"
    + EOT
    + "  tail"
)


SP_KINDS = ("bpe", "unigram", "bpe-unk", "unigram-unk")


def training_text() -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2000)]


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory):
    """Tiny sentencepiece models (BPE and unigram) trained here: byte fallback for unseen characters, and
    (-unk) without it, the rarest characters left out, so unseen ones are <unk>."""
    d = tmp_path_factory.mktemp("sp")
    out = {}
    for name in SP_KINDS:
        proto = io.BytesIO()
        fallback = not name.endswith("-unk")
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(training_text()),
            model_writer=proto,
            vocab_size=320,
            hard_vocab_limit=False,
            model_type=name.split("-")[0],
            byte_fallback=fallback,
            character_coverage=1.0 if fallback else 0.99,
            minloglevel=2,
        )
        (d / f"{name}.model").write_bytes(proto.getvalue())
        out[name] = d / f"{name}.model"
    return out


def tiktoken_file(d, pattern: str = GPT4_PATTERN, side: bool = True):
    """A tiny tiktoken encoding trained by tiktoken's own (educational) trainer, written as
    load_tiktoken_bpe reads it, with <|endoftext|> after the ranks; the tiktoken.Encoding it stands for."""
    from tiktoken._educational import bpe_train

    ranks = bpe_train("\n".join(training_text())[:20_000], 300, pattern)
    path = d / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    specials = {EOT: len(ranks)}
    if side:
        (d / "tiny.tiktoken.json").write_text(json.dumps({"pattern": pattern, "special_tokens": specials}))
    enc = tiktoken.Encoding("tiny", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    return path, enc


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_ids_equal_the_library(sp_models, kind):
    tok = load_given_tokenizer(sp_models[kind])
    sp = spm.SentencePieceProcessor(model_file=str(sp_models[kind]))
    want = []
    for i, part in enumerate(HELD_OUT.split(EOT)):  # the marker is the model's end-of-sentence id
        want += ([sp.eos_id()] if i else []) + sp.encode(part)
    assert tok.encode(HELD_OUT) == want and want.count(2) == 2
    assert (tok.eot, tok.eot_id, tok.vocab_size) == ("</s>", 2, sp.get_piece_size())
    assert tok.encode("a</s>b") == tok.encode("a" + EOT + "b")  # its own marker's text too
    assert tok.decode(tok.encode("def f(x): café")) == "def f(x): café"


@pytest.mark.parametrize(
    "side", [True, False]
)  # without the side file: cl100k's pattern, eot after the ranks
def test_tiktoken_file_ids_equal_tiktoken(tmp_path, side):
    path, enc = tiktoken_file(tmp_path, side=side)
    tok = load_given_tokenizer(path)
    want = enc.encode(HELD_OUT, allowed_special="all")
    assert tok.encode(HELD_OUT) == want and want.count(enc.eot_token) == 2
    assert (tok.eot, tok.eot_id, tok.vocab_size) == (EOT, enc.eot_token, enc.n_vocab)
    assert tok.decode(want) == HELD_OUT


def test_prepare_writes_the_libraries_ids(tmp_path, sp_models):
    docs = ["def f(x):\n    return x  # café 🙂", "Привет мир naïve fox", "日本語 lazy dog"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs * 20))
    sp = spm.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    path, enc = tiktoken_file(tmp_path)
    for name, given, ids in (
        ("sp", sp_models["bpe"], lambda t: [sp.eos_id()] + sp.encode(t)),
        ("tt", path, lambda t: [enc.eot_token] + enc.encode_ordinary(t)),
    ):
        out = tmp_path / name
        args = ["data", "prepare", "--input", str(tmp_path / "in.jsonl"), "--out", str(out)]
        assert main([*args, "--tokenizer", str(given), "--val-fraction", "0.3"]) == 0
        meta = json.loads((out / "meta.json").read_text())
        train = np.concatenate(open_split(out, "train")).tolist()
        assert train[: len(ids(docs[0]))] == ids(docs[0])  # each document opened by the end-of-text id
        assert meta["tokenizer"]["eot_id"] == ids("")[0]
        assert load_tokenizer(out, meta).encode(HELD_OUT) == load_given_tokenizer(given).encode(HELD_OUT)


def test_hf_export_keeps_the_sentencepiece_model(tmp_path, sp_models):
    from loom.model.hf_io import write_tokenizer

    notes = write_tokenizer(load_given_tokenizer(sp_models["bpe"]), tmp_path, 64)
    assert (tmp_path / "tokenizer.model").read_bytes() == sp_models["bpe"].read_bytes()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert "tokenizer.model only" in notes[0]


def test_conversions_round_trip(tmp_path):
    path, enc = tiktoken_file(tmp_path)
    want = enc.encode(HELD_OUT, allowed_special="all")
    # tiktoken -> tokenizer.json -> tiktoken: the ids, and the same ranks written back
    assert main(["data", "tokenizer", "convert", str(path), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert load_given_tokenizer(tmp_path / "hf" / "tokenizer.json").encode(HELD_OUT) == want
    convert_tokenizer(tmp_path / "hf", "tiktoken", tmp_path / "tt")
    back = tmp_path / "tt" / "tokenizer.tiktoken"
    assert back.read_text() == path.read_text() and load_given_tokenizer(back).encode(HELD_OUT) == want
    # gpt2's files hold gpt2's pattern only: a gpt2-pattern encoding goes to them and back. They cannot mark
    # a token special, and loom reads them as it always has (the end-of-text text as its characters: a data
    # folder prepared from them keeps its tokenizer's hash), so the text here has no end-of-text marker
    (tmp_path / "g").mkdir()
    path2, enc2 = tiktoken_file(tmp_path / "g", pattern=GPT2_PATTERN)
    plain = HELD_OUT.replace(EOT, "\n")
    want2 = enc2.encode(plain)
    files = convert_tokenizer(path2, "gpt2", tmp_path / "gpt2")
    assert [f.name for f in files] == ["vocab.json", "merges.txt"]
    assert load_given_tokenizer(tmp_path / "gpt2").encode(plain) == want2
    convert_tokenizer(tmp_path / "gpt2", "tiktoken", tmp_path / "tt2")
    assert (tmp_path / "tt2" / "tokenizer.tiktoken").read_text() == path2.read_text()
    assert load_given_tokenizer(tmp_path / "tt2" / "tokenizer.tiktoken").encode(HELD_OUT) == enc2.encode(
        HELD_OUT, allowed_special="all"
    )


def sp_ids(sp, text: str) -> list[int]:
    """sentencepiece's ids of a text with </s> markers: each stretch between them encoded, the marker its id."""
    want = []
    for i, part in enumerate(text.split("</s>")):
        want += ([sp.eos_id()] if i else []) + sp.encode(part)
    return want


@pytest.mark.parametrize("kind", SP_KINDS)
def test_sentencepiece_converts_to_hf_with_its_ids(tmp_path, sp_models, kind):
    """.model -> tokenizer.json (transformers' converter): sentencepiece's ids through `tokenizers`, loom and
    transformers, bos/eos/unk named at their ids, and the tokenizer.json converts to itself."""
    from transformers import PreTrainedTokenizerFast

    sp = spm.SentencePieceProcessor(model_file=str(sp_models[kind]))
    text = HELD_OUT.replace(EOT, "</s>")
    want = sp_ids(sp, text)
    assert want.count(sp.eos_id()) == 2 and (sp.unk_id() in want) == kind.endswith("-unk")
    assert (
        main(["data", "tokenizer", "convert", str(sp_models[kind]), "--to", "hf", str(tmp_path / "hf")]) == 0
    )
    tok = load_given_tokenizer(tmp_path / "hf")
    assert tok.encode(text) == want and (tok.eot, tok.eot_id, tok.vocab_size) == (
        "</s>",
        2,
        sp.get_piece_size(),
    )
    hf = PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    assert hf.encode(text, add_special_tokens=False) == want
    named = (hf.bos_token, hf.bos_token_id, hf.eos_token, hf.eos_token_id, hf.unk_token, hf.unk_token_id)
    assert named == ("<s>", sp.bos_id(), "</s>", sp.eos_id(), "<unk>", sp.unk_id())
    if not kind.endswith("-unk"):  # <unk> decodes to nothing in one and to ' ⁇ ' in the other
        assert hf.decode(want, skip_special_tokens=True) == sp.decode(want)
    convert_tokenizer(tmp_path / "hf", "hf", tmp_path / "back")
    assert load_given_tokenizer(tmp_path / "back").encode(text) == want


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_to_byte_level_bpe_is_refused(tmp_path, sp_models, kind):
    """gpt2's files and tiktoken are byte-level BPE: their ids always spell the text's bytes back. The model's
    pieces for the held-out text do not (its dummy prefix '▁' before the text, its normaliser), so no such file
    can give its ids; a unigram model has no merges besides."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_models[kind]))
    text = HELD_OUT.replace(EOT, "")
    spelt = "".join(sp.id_to_piece(i) for i in sp.encode(text)).replace("\u2581", " ")
    assert spelt != text and spelt.startswith(" def")
    why = "it is a unigram model" if kind == "unigram" else "its BPE works on normalised characters"
    for to in ("gpt2", "tiktoken"):
        with pytest.raises(LoomError, match=f"--to {to} cannot hold the sentencepiece model .*: {why}") as e:
            convert_tokenizer(sp_models[kind], to, tmp_path / to)
        assert "--to hf" in e.value.hint and not (tmp_path / to).exists()


def test_even_a_byte_faithful_sentencepiece_bpe_is_no_byte_level_bpe():
    """The measurement behind the refusal, on the model most like a byte-level BPE (identity normaliser, no
    dummy prefix, spaces kept, byte fallback): its pieces spell the text back, but an ASCII character is two
    pieces of the same bytes (a character and a byte piece), a character it holds whole needs its byte prefixes
    as extra tokens, and an unseen emoji sharing one (😀 beside 🙂) then gets an id sentencepiece never gives."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()),
        model_writer=proto,
        vocab_size=320,
        hard_vocab_limit=False,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())

    def piece_bytes(i: int) -> bytes:
        p = sp.id_to_piece(i)
        return bytes([int(p[3:5], 16)]) if sp.is_byte(i) else p.replace("\u2581", " ").encode()

    # a character piece ('a') and its byte piece (<0x61>) are the same bytes: the character's id wins here
    ids = sorted(range(sp.get_piece_size()), key=sp.is_byte, reverse=True)
    ranks = {piece_bytes(i): i for i in ids if not sp.is_control(i) and not sp.is_unknown(i)}
    assert len(ranks) < sp.get_piece_size() - 3  # so a byte-level BPE cannot hold every id of the model
    pieces = [t.decode() for t in ranks if len(t) > 1 or t[0] < 0x80]  # the byte pieces are no characters
    prefixes = {c.encode()[:k] for t in pieces for c in t for k in range(2, len(c.encode()))}
    missing = sorted(prefixes - set(ranks))
    assert missing  # tokens, so ids, that sentencepiece does not have
    for n, extra in enumerate(missing):
        ranks[extra] = sp.get_piece_size() + n
    enc = tiktoken.Encoding("sp", pat_str=r"[\s\S]+", mergeable_ranks=ranks, special_tokens={})
    text = HELD_OUT.replace(EOT, "\n")
    want, got = sp.encode(text), enc.encode_ordinary(text)
    assert b"".join(piece_bytes(i) for i in want) == text.encode()
    k = next(k for k, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
    first = [sp.id_to_piece(i) for i in want[k : k + 2]]
    assert first == ["<0xF0>", "<0x9F>"] and got[k] >= sp.get_piece_size()


def test_chat_data_with_a_sentencepiece_model(tmp_path, sp_models):
    """--chat with a .model: its tokenizer.json (sentencepiece's ids) with loom's chat tokens after them; the
    base tokenizer's hash is the .model's, what a run pretrained on it records (loom.train.finetune)."""
    from loom.data.tokenizers import tokenizer_hash

    sp = spm.SentencePieceProcessor(model_file=str(sp_models["bpe"]))
    pairs = [("def f(x): café 🙂", "return x 日本語"), ("Привет мир", "naïve fox\n  tail")]
    rows = [{"prompt": p, "completion": c} for p, c in pairs * 10]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "fox dog"}) + "\n")
    given = ["--tokenizer", str(sp_models["bpe"])]
    chat = ["prepare", "--chat", "--block-size", "64", "--input", str(tmp_path / "c.jsonl")]
    assert data([*chat, "--out", str(tmp_path / "c"), *given]) == 0
    assert data(["prepare", "--input", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "t"), *given]) == 0
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    ids = meta["chat"]["tokens"]
    assert meta["tokenizer"]["kind"] == "tokenizer.json" and sorted(ids.values()) == list(range(320, 326))
    pretrain = tmp_path / "t"
    assert meta["chat"]["base_tokenizer_hash"] == tokenizer_hash(
        pretrain, json.loads((pretrain / "meta.json").read_text())
    )
    train = np.concatenate(open_split(tmp_path / "c", "train")).tolist()
    user, assistant = [ids[f"<|{r}_start|>"] for r in ("user", "assistant")], ids["<|assistant_end|>"]
    rendered = [
        [sp.eos_id(), user[0], *sp.encode(p), ids["<|user_end|>"], user[1], *sp.encode(c), assistant]
        for p, c in pairs
    ]
    assert any(train[: len(r)] == r for r in rendered)


def test_bad_input_is_one_clear_error(tmp_path, sp_models):
    path, _ = tiktoken_file(tmp_path)
    with pytest.raises(LoomError, match="gpt2's pattern; this one splits with another"):
        convert_tokenizer(path, "gpt2", tmp_path / "g")
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64!! x\n")
    with pytest.raises(LoomError, match="line 1 is not 'BASE64-TOKEN RANK'"):
        load_given_tokenizer(bad)
    (tmp_path / "x.model").write_bytes(b"garbage")
    with pytest.raises(LoomError, match="is not a sentencepiece model"):
        load_given_tokenizer(tmp_path / "x.model")
    with pytest.raises(LoomError, match="'.*hf' exists and is not empty"):
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "f").write_text("x")
        convert_tokenizer(path, "hf", tmp_path / "hf")


def write_ranks(path, ranks: list[tuple[bytes, int]], side: dict | None = None):
    """A tiktoken file of (token, rank) lines as given (duplicates and gaps kept), and its side file."""
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks))
    if side is not None:
        (path.parent / (path.name + ".json")).write_text(json.dumps(side))
    return path


BYTES = [(bytes([i]), i) for i in range(256)]


@pytest.mark.parametrize(
    "extra, words",
    [
        ([(b"ab", 256), (b"cd", 300)], r"ranks 257, 258, 259 \(and 40 more\) are missing"),
        ([(b"ab", 256), (b"cd", 256)], "rank 256 is given twice"),
        ([(b"ab", 256), (b"ab", 257)], r"the token b'ab' is listed twice \(ranks 256 and 257\)"),
    ],
    ids=["gap", "duplicate-rank", "duplicate-token"],
)
def test_prepare_refuses_a_tiktoken_file_with_gaps_or_duplicates(tmp_path, capsys, extra, words):
    """Before: a gap gave ids past the counted vocabulary, a duplicate rank encoded 'ab' and 'cd' alike."""
    path = write_ranks(tmp_path / "t.tiktoken", BYTES + extra)
    (tmp_path / "in.txt").write_text("abcd " * 50)
    args = ["data", "prepare", "--input", str(tmp_path / "in.txt"), "--out", str(tmp_path / "out")]
    assert main([*args, "--tokenizer", str(path)]) != 0
    assert not (tmp_path / "out" / "meta.json").exists()
    with pytest.raises(LoomError, match=words):
        load_given_tokenizer(path)


def test_a_side_file_pattern_that_does_not_compile_is_one_clear_error(tmp_path):
    path = write_ranks(tmp_path / "t.tiktoken", BYTES, {"pattern": r"(\w+", "special_tokens": {EOT: 256}})
    with pytest.raises(
        LoomError, match=r"t.tiktoken.json': the split pattern '\(\\\\w\+' is not a valid regular"
    ):
        load_given_tokenizer(path)
    write_ranks(path, BYTES, {"pattern": 5, "special_tokens": {EOT: 256}})
    with pytest.raises(LoomError, match='"pattern" must be a regular expression'):
        load_given_tokenizer(path)


def test_an_end_of_text_id_past_the_shard_width_is_one_clear_error(tmp_path):
    """eot 100257 after 256 ranks (cl100k's gap before its specials): the vocabulary counts up to that id, so
    auto picks uint32 shards that hold it, and --dtype uint16 is refused naming the end-of-text id."""
    path = write_ranks(tmp_path / "t.tiktoken", BYTES, {"special_tokens": {EOT: 100257}})
    tok = load_given_tokenizer(path)
    assert (tok.eot_id, tok.vocab_size) == (100257, 100258)
    (tmp_path / "in.txt").write_text("abcd " * 50)
    args = ["data", "prepare", "--input", str(tmp_path / "in.txt"), "--tokenizer", str(path)]
    with pytest.raises(LoomError, match=r"end-of-text id 100,257 \(<\|endoftext\|>\) does not fit in uint16"):
        prepare([tmp_path / "in.txt"], tmp_path / "o16", tokenizer=str(path), dtype="uint16")
    assert main([*args, "--out", str(tmp_path / "auto")]) == 0
    meta = json.loads((tmp_path / "auto" / "meta.json").read_text())
    assert meta["vocab_size"] == 100258
    assert np.concatenate(open_split(tmp_path / "auto", "train")).max() == 100257
