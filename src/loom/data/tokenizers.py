"""Tokenizers: character-level (vocabulary from the corpus), byte-level BPE trained here, or an existing
HF `tokenizer.json`. Every tokenizer has an end-of-text id that separates documents.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from loom import log
from loom.errors import LoomError

EOT = "<|endoftext|>"
# End-of-text tokens of other families, used as the document separator when a tokenizer.json has one (Llama 3,
# Llama 2 / Mistral, Gemma) instead of adding gpt2's, which would make the vocabulary one larger than the model
EOT_ALIASES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
SPECIAL_TOKENS = (EOT,)  # declared once: a trained tokenizer gets these ids first, in this order


class CharTokenizer:
    """One id per distinct character (sorted), then the end-of-text id, then any special tokens (the chat
    tokens of loom.data.chat), in that order. Saved as char_vocab.json: {"chars": [...]} and, when there are
    special tokens, "specials": [...].

    `encode` of text never yields a special id (a special token's text inside a message is its characters);
    `decode` writes end-of-text as a newline and a special token as its text (`<|user_start|>`)."""

    kind = "char"
    filename = "char_vocab.json"
    eot = EOT  # the end-of-text token's text (the name HFTokenizer gives it: chat templates write it out)

    def __init__(self, chars: list[str], specials: list[str] | tuple[str, ...] = ()):
        self.chars = list(chars)
        self.specials = list(specials)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.eot_id = len(self.chars)
        self.special_ids = {t: self.eot_id + 1 + i for i, t in enumerate(self.specials)}
        self.vocab_size = len(self.chars) + 1 + len(self.specials)

    @classmethod
    def train(cls, texts) -> CharTokenizer:
        seen: set[str] = set()
        for t in texts:
            seen.update(t)
        return cls(sorted(seen))

    def token_id(self, text: str) -> int | None:
        """The id of a token by its text (end-of-text or a special token), else None."""
        return self.eot_id if text == EOT else self.special_ids.get(text)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise LoomError(f"character {e.args[0]!r} is not in the character vocabulary") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        n, specials = len(self.chars), self.specials
        return "".join(
            self.chars[i]
            if i < n
            else ("\n" if i == n else (specials[i - n - 1] if i - n - 1 < len(specials) else ""))
            for i in ids
        )

    def save(self, out_dir: str | Path) -> str:
        content = {"chars": self.chars, **({"specials": self.specials} if self.specials else {})}
        (Path(out_dir) / self.filename).write_text(json.dumps(content), encoding="utf-8")
        return self.filename


def check_bpe_vocab(vocab_size: int) -> None:
    min_vocab = 256 + len(SPECIAL_TOKENS) + 1  # every byte, the special tokens, at least one merge
    if vocab_size < min_vocab:
        raise LoomError(
            f"--vocab-size {vocab_size} is too small for byte-level BPE",
            hint=f"use at least {min_vocab} (256 byte tokens + end-of-text + merges), e.g. 4096",
        )


class HFTokenizer:
    """A `tokenizers` library tokenizer (byte-level BPE trained here, or any tokenizer.json)."""

    kind = "bpe"
    filename = "tokenizer.json"

    def __init__(self, tok):
        self.tok = tok
        self.eot = next((t for t in EOT_ALIASES if tok.token_to_id(t) is not None), EOT)
        if tok.token_to_id(self.eot) is None:  # a tokenizer.json without an end-of-text token: add gpt2's
            tok.add_special_tokens([EOT])
        self.eot_id = tok.token_to_id(self.eot)
        # ids may skip some (a tiktoken file's end-of-text id after a gap, as cl100k's 100257): the model's
        # embedding and the shards' dtype must hold the largest id, not only as many rows as there are tokens
        self.vocab_size = max(
            tok.get_vocab_size(with_added_tokens=True),
            max(tok.get_vocab(with_added_tokens=True).values()) + 1,
        )

    @classmethod
    def train(cls, texts, vocab_size: int, pattern: str = "gpt2", trainer: str = "auto") -> HFTokenizer:
        """Byte-level BPE trained on `texts` (a list of str). `pattern`: gpt2 (gpt2's pre-tokenizer split)
        or gpt4 (cl100k's: digits in groups of at most 3, no leading space on punctuation runs). `trainer`:
        rustbpe (loom.data.bpe), tokenizers (the library's BpeTrainer) or auto (rustbpe when installed)."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

        from loom.data.encode import GPT2_PATTERN, GPT4_PATTERN

        check_bpe_vocab(vocab_size)
        if pattern not in ("gpt2", "gpt4"):
            raise LoomError(f"unknown split pattern '{pattern}'", hint="use gpt2 or gpt4")
        if trainer in ("auto", "rustbpe"):
            try:
                from loom.data.bpe import train_rustbpe

                regex = GPT4_PATTERN if pattern == "gpt4" else GPT2_PATTERN
                return cls(train_rustbpe(texts, vocab_size, regex, SPECIAL_TOKENS)).said_short(vocab_size)
            except ImportError:
                if trainer == "rustbpe":
                    raise LoomError(
                        "the rustbpe trainer is not installed", hint="pip install 'loom[data]'"
                    ) from None
        tok = Tokenizer(models.BPE())
        if pattern == "gpt4":
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(GPT4_PATTERN), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok).said_short(vocab_size)

    def said_short(self, asked: int) -> HFTokenizer:
        """A trained vocabulary smaller than asked (the corpus has fewer distinct pairs to merge than the
        merges asked for) is said, not left for the user to find in meta.json."""
        if self.vocab_size < asked:
            merges = self.vocab_size - 256 - len(SPECIAL_TOKENS)  # past the 256 bytes and the special tokens
            log.warn(
                f"BPE vocabulary: {asked:,} asked, the corpus gave only {merges:,} merges, so the vocabulary "
                f"is {self.vocab_size:,} (more text gives more merges)"
            )
        return self

    @classmethod
    def from_vocab_files(cls, vocab: Path, merges: Path) -> HFTokenizer:
        """gpt2's tokenizer from OpenAI's encoder.json + vocab.bpe (or the same as vocab.json + merges.txt)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise LoomError(f"'{vocab}' + '{merges}' are not a BPE vocabulary and merges: {e}") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise LoomError(f"'{path}' is not a valid tokenizer.json: {e}") from None

    def token_id(self, text: str) -> int | None:
        """The id of a token by its text (an added or special token, or one of the model's), else None."""
        return self.tok.token_to_id(text)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # The Rust side parallelises over the batch with all cores.
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def save(self, out_dir: str | Path) -> str:
        self.tok.save(str(Path(out_dir) / self.filename))
        return self.filename


VOCAB_FILE_PAIRS = (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt"))


def tokenizer_files(spec: str | Path) -> list[Path]:
    """The files of a given tokenizer: a tokenizer.json, or a folder holding one, or gpt2's vocabulary and
    merges (encoder.json + vocab.bpe, or vocab.json + merges.txt), a sentencepiece .model or a tiktoken file
    (its side file FILE.json too, when there is one: loom.data.tokenizer_formats)."""
    path = Path(spec)
    side = Path(str(path) + ".json")
    if path.is_file() and path.suffix == ".tiktoken" and side.is_file():
        return [path, side]
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (path / name).is_file():
                return [path / name]
        for pair in VOCAB_FILE_PAIRS:
            if all((path / f).is_file() for f in pair):
                return [path / f for f in pair]
    elif path.is_file():
        return [path]
    raise LoomError(
        f"--tokenizer '{spec}' is neither char, bpe nor an existing tokenizer file",
        hint="char, bpe, the path of a tokenizer.json, a sentencepiece .model or a .tiktoken file, or a folder "
        "holding tokenizer.json or tokenizer.model (or gpt2's encoder.json + vocab.bpe)",
    )


def load_given_tokenizer(spec: str | Path):
    """The tokenizer named by --tokenizer PATH (see tokenizer_files): HFTokenizer, or a
    SentencePieceTokenizer for a sentencepiece .model (a tiktoken file becomes an HFTokenizer)."""
    from loom.data import tokenizer_formats
    from loom.data.spm import SentencePieceTokenizer

    files = tokenizer_files(spec)
    if files[0].suffix == ".model":
        return SentencePieceTokenizer.from_file(files[0])
    if files[0].suffix == ".tiktoken":
        return HFTokenizer(tokenizer_formats.load_tiktoken(files[0]))
    return HFTokenizer.from_file(files[0]) if len(files) == 1 else HFTokenizer.from_vocab_files(*files)


def convert_tokenizer(src: str | Path, to: str, out: str | Path, force: bool = False) -> list[Path]:
    """`loom data tokenizer convert SRC --to FORMAT OUT`: the tokenizer SRC (any --tokenizer PATH) written as
    FORMAT into the folder OUT: hf (tokenizer.json), gpt2 (vocab.json + merges.txt) or tiktoken
    (tokenizer.tiktoken + tokenizer.tiktoken.json). Returns the files written."""
    from loom.data.tokenizer_formats import FORMATS, write_gpt2, write_tiktoken

    if to not in FORMATS:
        raise LoomError(f"--to {to} is not a tokenizer format loom writes", hint=f"use {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise LoomError(f"'{out}' exists and is not empty", hint="choose a new folder, or pass --force")
    tok = load_given_tokenizer(src)
    if tok.kind == "sentencepiece":
        return _convert_sentencepiece(tok.proto, src, to, out)
    if tok.tok.token_to_id(tok.eot) is not None:  # named special in what is written (gpt2's files cannot say)
        tok.tok.add_special_tokens([tok.eot])
    out.mkdir(parents=True, exist_ok=True)
    text = tok.tok.to_str()
    if to == "tiktoken":
        return write_tiktoken(text, out / "tokenizer.tiktoken")
    if to == "gpt2":
        return write_gpt2(text, out)
    (out / "tokenizer.json").write_text(text, encoding="utf-8")
    return [out / "tokenizer.json"]


def _convert_sentencepiece(proto: bytes, src, to: str, out: Path) -> list[Path]:
    """A sentencepiece model as tokenizer.json (transformers' converter: the library's ids) and a
    tokenizer_config.json naming its bos, eos and unk tokens; --to gpt2 | tiktoken are refused, with why."""
    from loom.data import tokenizer_formats as tf

    if to != "hf":
        tf.refuse_sentencepiece_bytes(proto, src, to)
    tok = tf.sentencepiece_to_tokenizer(proto)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tf.sentencepiece_names(proto)}
    config |= {"add_bos_token": False, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return [out / "tokenizer.json", out / "tokenizer_config.json"]


def has_tokenizer(meta: dict) -> bool:
    """Whether meta.json describes a tokenizer that load_tokenizer can build (a file, or a character table),
    not only ids (a tokenizer entry may hold just the end-of-text id: `loom data convert --eot-id`)."""
    info = meta.get("tokenizer")
    return isinstance(info, dict) and ("file" in info or "chars" in info)


def load_tokenizer(directory: str | Path, meta: dict) -> CharTokenizer | HFTokenizer:
    """The tokenizer described by a meta.json (`tokenizer.kind`, `tokenizer.file`) in `directory`, or a
    character table carried in the meta itself (`tokenizer.chars`: a nanogpt meta.pkl vocabulary)."""
    info = _tokenizer_info(directory, meta)
    if not info:
        raise LoomError(
            f"no tokenizer is known for the data in '{directory}' (token ids only)",
            hint="put the tokenizer's meta.json (or nanogpt's meta.pkl) beside the data",
        )
    try:
        if info.get("kind") == "char" and "chars" in info:
            return CharTokenizer(list(info["chars"]))
        path = Path(directory) / info.get("file", "")
        if not path.is_file():
            raise LoomError(f"tokenizer file '{path}' is missing", hint="prepare the data again")
        if info.get("kind") == "char":
            raw = json.loads(path.read_text(encoding="utf-8"))
            return CharTokenizer(raw["chars"], raw.get("specials") or ())
        if info.get("kind") == "sentencepiece":
            from loom.data.spm import SentencePieceTokenizer

            return SentencePieceTokenizer.from_file(path)
        return HFTokenizer.from_file(path)
    except LoomError:
        raise
    except Exception as e:  # a meta.json or tokenizer file that parses but describes no usable tokenizer
        raise LoomError(
            f"cannot load the tokenizer of '{directory}': {type(e).__name__}: {e}",
            hint="prepare the data again",
        ) from None


def _tokenizer_info(directory: str | Path, meta: dict) -> dict:
    """meta's tokenizer entry, checked: a table whose `file` is a plain name inside the data directory."""
    info = meta.get("tokenizer") or {}
    file = info.get("file", "") if isinstance(info, dict) else None
    if not isinstance(file, str) or "/" in file or "\\" in file or file in (".", ".."):
        raise LoomError(
            f"the tokenizer entry of '{directory}/meta.json' is malformed (file must be a plain name)",
            hint="prepare the data again",
        )
    return info


def run_tokenizer_dir(run_dir: str | Path) -> Path:
    """`RUN/tokenizer/`, the copy of its data's tokenizer a run was trained with (copy_tokenizer), with its
    meta.json. A run without it is refused naming that folder, not as a bad data.path (which it is not)."""
    d = Path(run_dir) / "tokenizer"
    if (d / "meta.json").is_file():
        return d
    where = "its data set"
    try:  # run.json records the data the run read, whose tokenizer this folder copies
        data_dir = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8")).get("data_dir")
        where = f"its data set '{data_dir}'" if isinstance(data_dir, str) else where
    except (OSError, ValueError, AttributeError):
        pass
    what = "has no meta.json" if d.is_dir() else "is missing"
    raise LoomError(
        f"run '{run_dir}' has no tokenizer: '{d}' {what} (a run keeps a copy of its data's tokenizer there, to "
        "read and write text with its ids)",
        hint=f"copy the tokenizer of {where} back: its meta.json and tokenizer file into '{d}/'",
    )


def copy_tokenizer(src_dir: str | Path, meta: dict, dst_dir: str | Path) -> None:
    """Copy the tokenizer file (and meta.json) so a run directory is self-contained for generate/eval.

    Written once: a resumed run keeps the tokenizer its checkpoints were trained with (resume checks that
    the data's is the same, by content: check_same_tokenizer)."""
    info = _tokenizer_info(src_dir, meta)
    dst = Path(dst_dir)
    if (dst / "meta.json").is_file():
        return
    dst.mkdir(parents=True, exist_ok=True)
    if info.get("file"):  # none when the data has no tokenizer, or carries its vocabulary in meta
        shutil.copy2(Path(src_dir) / info["file"], dst / info["file"])
    (dst / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")


# ------------------------------------------------------------------------------ comparing by content


def _tokenizer_content(directory: str | Path, meta: dict) -> dict | None:
    """What decides a tokenizer's ids, in a canonical form: a char table, or a BPE's vocabulary, merges and
    added tokens (not the file's layout, which changes between `tokenizers` versions). None without one."""
    info = _tokenizer_info(directory, meta)
    if not info:
        return None
    if info.get("kind") == "char" and "chars" in info:
        return {"kind": "char", "chars": list(info["chars"])}
    path = Path(directory) / info.get("file", "")
    if info.get("kind") == "sentencepiece":  # the model file decides every id
        import hashlib

        return {"kind": "sentencepiece", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoomError(
            f"cannot read the tokenizer file '{path}': {e}", hint="prepare the data again"
        ) from None
    if info.get("kind") == "char":
        specials = list(raw.get("specials") or [])  # only when present: plain char tables hash as before
        return {"kind": "char", "chars": list(raw["chars"]), **({"specials": specials} if specials else {})}
    model = raw.get("model") or {}
    merges = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model.get("merges") or []]
    added = sorted(
        (t.get("id"), t.get("content"), bool(t.get("special"))) for t in raw.get("added_tokens") or []
    )
    return {
        "kind": "bpe",
        "type": model.get("type"),
        "vocab": model.get("vocab") or {},
        "merges": merges,
        "added": [list(t) for t in added],
    }


def tokenizer_hash(directory: str | Path, meta: dict) -> str | None:
    """SHA-256 of the tokenizer's content (see _tokenizer_content): equal exactly when every text gets the same
    ids. Two char vocabularies of the same size but other characters differ. None for data without one."""
    import hashlib

    content = _tokenizer_content(directory, meta)
    if content is None:
        return None
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def _difference(a: dict, b: dict, names: tuple[str, str]) -> str:
    """What differs between two tokenizer contents, in words."""
    if a["kind"] != b["kind"]:
        return f"{names[0]} is {a['kind']}, {names[1]} is {b['kind']}"
    if a["kind"] == "char":
        only_a = sorted(set(a["chars"]) - set(b["chars"]))
        only_b = sorted(set(b["chars"]) - set(a["chars"]))
        na, nb = (len(c["chars"]) + 1 + len(c.get("specials", [])) for c in (a, b))
        parts = [f"{na} vs {nb} ids"]
        for name, only in zip(names, (only_a, only_b), strict=True):
            if only:
                parts.append(
                    f"only {name} has " + ", ".join(map(repr, only[:5])) + (" ..." if len(only) > 5 else "")
                )
        if a.get("specials", []) != b.get("specials", []):
            parts.append("special tokens differ")
        elif not only_a and not only_b:
            parts.append("the same characters in another order")
        return "character vocabularies differ (" + "; ".join(parts) + ")"
    va, vb = a["vocab"], b["vocab"]
    changed = sum(1 for t in set(va) | set(vb) if va.get(t) != vb.get(t))
    parts = [f"{len(va)} vs {len(vb)} tokens, {changed} with another id or missing"]
    if a["merges"] != b["merges"]:
        parts.append(f"merges differ ({len(a['merges'])} vs {len(b['merges'])})")
    if a["added"] != b["added"]:
        parts.append("added tokens differ")
    return "BPE vocabularies differ (" + "; ".join(parts) + ")"


def check_run_tokenizer(run_tok_dir: str | Path, data_dir: str | Path, data_meta: dict) -> None:
    """check_same_tokenizer of a run's saved tokenizer folder (its meta read here) and the data."""
    from loom.data.formats import read_meta

    check_same_tokenizer(run_tok_dir, read_meta(run_tok_dir), data_dir, data_meta)


def check_run_data(data_dir: str | Path, run_tok_dir: Path | None = None) -> dict:
    """formats.check_dir, and with `run_tok_dir` (a continued run's saved tokenizer folder) data prepared with
    another tokenizer refused: what a run asks of its data, answered in one call. Returns the data's meta."""
    from loom.data.formats import check_dir

    meta = check_dir(data_dir)
    if run_tok_dir is not None:
        # the run's checkpoints were trained with its tokenizer: data with another (same size or not) is refused
        check_run_tokenizer(run_tok_dir, Path(data_dir), meta)
    return meta


def check_same_tokenizer(
    run_tok_dir: str | Path, run_meta: dict, data_dir: str | Path, data_meta: dict
) -> None:
    """Refuse data whose tokenizer is not the run's (compared by content, not by vocabulary size): its ids
    would mean other text to the model, and the loss would silently measure something else."""
    if tokenizer_hash(run_tok_dir, run_meta) == tokenizer_hash(data_dir, data_meta):
        return
    a, b = _tokenizer_content(run_tok_dir, run_meta), _tokenizer_content(data_dir, data_meta)
    if a is None or b is None:
        what = (
            "the run has a tokenizer and the data token ids only"
            if b is None
            else ("the data has a tokenizer and the run token ids only")
        )
    else:
        what = _difference(a, b, ("the run's", "the data's"))
    raise LoomError(
        f"'{data_dir}' was prepared with another tokenizer than the run's: {what}",
        hint=f"use data prepared with the run's tokenizer ({run_tok_dir}), e.g. the data it was trained on",
    )
