"""A sentencepiece `.model` as loom's tokenizer (Llama 2, Mistral, Megatron's SentencePieceTokenizer), encoded
by the sentencepiece library itself: its normaliser and unigram or BPE search are its own, so the ids are
exactly the library's (tests/unit/test_tokenizer_formats.py)."""

from __future__ import annotations

import re
from pathlib import Path

from loom.errors import LoomError

EOT = "<|endoftext|>"


class SentencePieceTokenizer:
    """A sentencepiece model, encoded by the sentencepiece library. End of text is the model's end-of-sentence
    piece (`</s>`): its text, or gpt2's <|endoftext|>, inside a text is that id (as an added token is in
    `tokenizers`), and every other stretch of text gets the library's own ids (no begin-of-sentence id added)."""

    kind = "sentencepiece"
    filename = "tokenizer.model"

    def __init__(self, proto: bytes, source: str = "sentencepiece model"):
        try:
            import sentencepiece as spm
        except ImportError:
            raise LoomError(
                "a sentencepiece .model needs sentencepiece", hint="pip install 'loom[data]'"
            ) from None
        self.proto = proto
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(proto)
        except Exception as e:  # the library raises RuntimeError / OSError for a malformed model
            raise LoomError(f"'{source}' is not a sentencepiece model: {e}") from None
        self.eot_id = self.sp.eos_id()
        if self.eot_id < 0:
            raise LoomError(
                f"'{source}' has no end-of-sentence piece, which loom needs to separate documents",
                hint="train it with eos_id set (sentencepiece's default: 2)",
            )
        self.eot = self.sp.id_to_piece(self.eot_id)
        self.vocab_size = self.sp.get_piece_size()
        self.marker = re.compile("|".join(re.escape(t) for t in {self.eot, EOT}))

    @classmethod
    def from_file(cls, path: str | Path) -> SentencePieceTokenizer:
        return cls(Path(path).read_bytes(), str(path))

    def token_id(self, text: str) -> int | None:
        i = self.sp.piece_to_id(text)
        return i if self.sp.id_to_piece(i) == text else None

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for n, part in enumerate(self.marker.split(text)):
            if n:
                out.append(self.eot_id)
            if part:
                out += self.sp.encode(part)
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def save(self, out_dir: str | Path) -> str:
        (Path(out_dir) / self.filename).write_bytes(self.proto)
        return self.filename
