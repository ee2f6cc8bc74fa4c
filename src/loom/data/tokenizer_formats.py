"""Tokenizer files of other libraries: a sentencepiece `.model` (Llama 2, Mistral, Megatron's
SentencePieceTokenizer) and a tiktoken encoding file (base64 token, rank per line: what
`tiktoken.load_tiktoken_bpe` reads), and `loom data tokenizer convert` between them and `tokenizers`' formats.

A tiktoken file is byte-level BPE: it becomes a `tokenizers` pipeline (tokenizers.HFTokenizer) whose ids equal tiktoken's
(merges derived from the ranks: the pair whose merged token has the lowest rank merges first, as in tiktoken).
The file holds neither the split pattern nor the special tokens: they are read from `FILE.json` beside it
({"pattern": ..., "special_tokens": {"<|endoftext|>": 100257}}), else cl100k's pattern and <|endoftext|> at the
first free id. A sentencepiece model is encoded by the sentencepiece library itself (spm.py).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from loom.data.encode import GPT2_PATTERN, GPT4_PATTERN, byte_decoder, tiktoken_spec
from loom.errors import LoomError

EOT = "<|endoftext|>"


# ------------------------------------------------------------------------------------------- tiktoken


def read_tiktoken(path: str | Path) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken encoding file, as tiktoken.load_tiktoken_bpe reads it."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as e:
        raise LoomError(f"cannot read the tiktoken file '{path}': {e}") from None
    ranks: dict[bytes, int] = {}
    line_of: dict[int, int] = {}  # rank -> the line that gave it, to name both lines of a duplicate
    for n, line in enumerate(lines, 1):
        try:
            if not line.strip():
                continue
            text, rank_text = line.split()
            token, rank = base64.b64decode(text, validate=True), int(rank_text)
        except ValueError:
            raise LoomError(
                f"'{path}' is not a tiktoken encoding file: line {n} is not 'BASE64-TOKEN RANK'"
            ) from None
        # a token or a rank given twice would silently encode two texts alike (or one text two ways)
        if token in ranks:
            raise LoomError(
                f"'{path}' line {n}: the token {token!r} is listed twice (ranks {ranks[token]} and {rank})",
                hint="each token appears once in a tiktoken encoding file",
            )
        if rank in line_of:
            raise LoomError(
                f"'{path}' line {n}: rank {rank} is given twice (lines {line_of[rank]} and {n})",
                hint="each rank is a token id and belongs to one token",
            )
        ranks[token], line_of[rank] = rank, n
    if len(ranks) < 256:
        raise LoomError(f"'{path}' has {len(ranks)} tokens: a tiktoken encoding has at least the 256 bytes")
    _refuse_gaps(path, sorted(line_of))
    return ranks


def _refuse_gaps(path: str | Path, ranks: list[int]) -> None:
    """The ranks must be the ids 0..n-1: a missing rank would leave an id no token has, and one past the
    vocabulary that tokenizers counts (the model's embedding would not hold it)."""
    if ranks[0] == 0 and ranks[-1] == len(ranks) - 1:
        return
    missing = sorted(set(range(ranks[-1] + 1)) - set(ranks)) if ranks[0] >= 0 else []
    what = f"rank {ranks[0]} is negative" if ranks[0] < 0 else f"ranks {_span(missing)} are missing"
    raise LoomError(
        f"'{path}' is not a complete tiktoken encoding: its {len(ranks):,} ranks are not 0..{len(ranks) - 1} "
        f"({what})",
        hint="a tiktoken encoding file numbers its tokens 0, 1, 2, ... without gaps",
    )


def _span(ids: list[int]) -> str:
    """The first few of a sorted list of ids, e.g. '256, 300, 301 (and 5 more)'."""
    more = f" (and {len(ids) - 3:,} more)" if len(ids) > 3 else ""
    return ", ".join(str(i) for i in ids[:3]) + more


def tiktoken_extras(path: str | Path, n_ranks: int) -> tuple[str, dict[str, int]]:
    """(split pattern, special tokens) of a tiktoken file: from PATH.json beside it, else cl100k's pattern and
    <|endoftext|> at the first id after the ranks."""
    side = Path(str(path) + ".json")
    if not side.is_file():
        return GPT4_PATTERN, {EOT: n_ranks}
    try:
        extra = json.loads(side.read_text(encoding="utf-8"))
        pattern = extra.get("pattern", GPT4_PATTERN)
        specials = {str(k): int(v) for k, v in extra["special_tokens"].items()}
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        raise LoomError(
            f"'{side}' is not a tiktoken side file: {type(e).__name__}: {e}",
            hint='write {"pattern": "...", "special_tokens": {"<|endoftext|>": ID}}',
        ) from None
    _check_pattern(side, pattern)
    negative = {k: v for k, v in specials.items() if v < 0}
    if negative:
        raise LoomError(f"'{side}': special token ids must be 0 or more, not {negative}")
    return pattern, specials


def _check_pattern(side: Path, pattern) -> None:
    """The side file's split pattern compiled as the encoder will compile it (tokenizers' Oniguruma regex):
    a pattern that does not compile is refused here, naming the file, not deep inside the encoder."""
    from tokenizers import Regex

    if not isinstance(pattern, str) or not pattern:
        raise LoomError(
            f"'{side}': \"pattern\" must be a regular expression (a non-empty string), not {pattern!r}"
        )
    try:
        Regex(pattern)
    except Exception as e:  # tokenizers raises a plain Exception with Oniguruma's message
        raise LoomError(
            f"'{side}': the split pattern {pattern!r} is not a valid regular expression ({e})",
            hint='write the pattern tiktoken splits text with, e.g. cl100k\'s (or leave "pattern" out to use it)',
        ) from None


def tiktoken_to_tokenizer(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]):
    """A `tokenizers` Tokenizer with tiktoken's ids: byte-level BPE on the pattern's pieces, the vocabulary in
    gpt2's byte alphabet, merges ordered by the rank of the token they make."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    enc = {b: c for c, b in byte_decoder().items()}

    def text(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    merges = []
    for token, rank in ranks.items():
        # every split of the token into two known tokens: the lower-ranked halves first, as tiktoken meets them
        splits = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks
        ]
        splits.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges += [(rank, text(a), text(b)) for a, b in splits]
    merges.sort(key=lambda m: m[0])
    vocab = {text(t): r for t, r in ranks.items()}
    taken = set(vocab.values()) & set(specials.values())
    if taken:
        raise LoomError(f"special token ids {sorted(taken)[:5]} are also ranks of the encoding's tokens")
    # the special tokens sit in the model's vocabulary with their ids, so the added tokens keep those ids
    vocab |= specials
    model = models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True) for name in specials])
    return tok


def load_tiktoken(path: str | Path):
    """The `tokenizers` Tokenizer of a tiktoken encoding file (its side file's pattern and special tokens)."""
    ranks = read_tiktoken(path)
    pattern, specials = tiktoken_extras(path, len(ranks))
    return tiktoken_to_tokenizer(ranks, pattern, specials)


def write_tiktoken(tokenizer_json: str, out: Path) -> list[Path]:
    """A byte-level BPE tokenizer.json as a tiktoken file OUT and its side file OUT.json (pattern, specials)."""
    spec = tiktoken_spec(tokenizer_json)
    if spec is None:
        raise LoomError(
            "this tokenizer is not a plain byte-level BPE, which is all a tiktoken file can hold",
            hint="convert byte-level BPE tokenizers (gpt2's, cl100k's, loom's bpe) to tiktoken",
        )
    lines = sorted((r, base64.b64encode(bytes.fromhex(h)).decode()) for h, r in spec["ranks"].items())
    out.write_text("".join(f"{t} {r}\n" for r, t in lines), encoding="utf-8")
    side = Path(str(out) + ".json")
    side.write_text(json.dumps({"pattern": spec["pattern"], "special_tokens": spec["special"]}, indent=1))
    return [out, side]


# ------------------------------------------------------------------------------------------- convert

FORMATS = ("hf", "gpt2", "tiktoken")


def write_gpt2(tokenizer_json: str, out: Path) -> list[Path]:
    """gpt2's vocab.json + merges.txt of a byte-level BPE with gpt2's split pattern (the files hold no
    pattern: GPT-2's is implied); the end-of-text token stays in vocab.json at its id, as in GPT-2's."""
    spec = tiktoken_spec(tokenizer_json)
    if spec is None or spec["pattern"] != GPT2_PATTERN:
        raise LoomError(
            "gpt2's vocab.json + merges.txt hold a byte-level BPE that splits text with gpt2's pattern; "
            + ("this one splits with another" if spec else "this tokenizer is no byte-level BPE"),
            hint="convert it --to hf (tokenizer.json) or --to tiktoken (its pattern in the side file)",
        )
    raw = json.loads(tokenizer_json)
    model = raw["model"]
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in raw.get("added_tokens") or []}}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return [out / "vocab.json", out / "merges.txt"]


# ------------------------------------------------------------------------------------------- sentencepiece

# sentencepiece_model.proto's piece types
SP_UNKNOWN, SP_CONTROL = 2, 3
SP_UNIGRAM = 1


def sentencepiece_proto(proto: bytes):
    """The parsed ModelProto of a sentencepiece model (the library ships its protobuf module)."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    return model


def sentencepiece_to_tokenizer(proto: bytes):
    """A `tokenizers` Tokenizer with a sentencepiece model's ids, built by transformers' own converter
    (SpmConverter.build_tokenizer_from_spm_proto: the model's normaliser, dummy prefix, BPE merges ranked by
    score or unigram scores, byte fallback). <unk>, <s> and </s> become special added tokens at their ids, as in
    Llama 2's tokenizer.json."""
    from tokenizers import AddedToken

    try:
        from transformers.convert_slow_tokenizer import SpmConverter
    except ImportError:
        raise LoomError(
            "converting a sentencepiece model needs transformers", hint="pip install 'loom[hf]'"
        ) from None
    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        raise LoomError(
            "this transformers has no SpmConverter.build_tokenizer_from_spm_proto, which converts a "
            "sentencepiece model by its own settings",
            hint="pip install -U transformers (5.x)",
        )
    model = sentencepiece_proto(proto)
    pieces = model.pieces
    if model.trainer_spec.model_type == SP_UNIGRAM:
        vocab = [(p.piece, p.score) for p in pieces]
    else:
        vocab = {p.piece: i for i, p in enumerate(pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(model, vocab)
    if tok is None:
        raise LoomError("this sentencepiece model is neither BPE nor unigram, which is all tokenizers holds")
    specials = [p.piece for p in pieces if p.type in (SP_UNKNOWN, SP_CONTROL)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def sentencepiece_names(proto: bytes) -> dict[str, str]:
    """bos/eos/unk token names of a sentencepiece model (tokenizer_config.json's keys), those it has."""
    spec = sentencepiece_proto(proto).trainer_spec
    names = {"bos_token": spec.bos_piece, "eos_token": spec.eos_piece, "unk_token": spec.unk_piece}
    ids = {"bos_token": spec.bos_id, "eos_token": spec.eos_id, "unk_token": spec.unk_id}
    return {k: v for k, v in names.items() if ids[k] >= 0}


def refuse_sentencepiece_bytes(proto: bytes, src, to: str) -> None:
    """Why gpt2's files and tiktoken cannot hold a sentencepiece model: both are a byte-level BPE on the raw
    bytes of the text, whose tokens always spell the text back byte for byte."""
    model = sentencepiece_proto(proto)
    if model.trainer_spec.model_type == SP_UNIGRAM:
        why = (
            "it is a unigram model: it picks the most likely split by its pieces' scores and has no merges, "
            "which are all a byte-level BPE holds"
        )
    else:
        why = (
            "its BPE works on normalised characters (its normaliser, a '▁' dummy prefix before the text, "
            "unknown characters as byte pieces or <unk>): its pieces do not spell the text back byte for "
            "byte, and a character it holds whole is no merge of bytes"
        )
    raise LoomError(
        f"--to {to} cannot hold the sentencepiece model '{src}' (gpt2's files and tiktoken are a byte-level "
        f"BPE on the raw bytes of the text, which cannot give its ids): {why}",
        hint="convert it --to hf (a tokenizer.json with sentencepiece's ids), or use the .model itself",
    )
