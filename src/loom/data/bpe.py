"""Byte-level BPE trained with rustbpe (nanochat's trainer, several times faster than the tokenizers
library's BpeTrainer here) and written as a tokenizers-library tokenizer with the same ids.

rustbpe gives mergeable ranks (token bytes -> id; the 256 bytes first), which is what tiktoken encodes with.
The tokenizers library needs the merges as pairs: each token's pair is found by running BPE on its bytes
with the ranks below its own until two parts are left (the pair it was made from). The pre-tokenizer is the
split pattern followed by byte-level mapping, and `ignore_merges` makes a piece that is a token whole one id,
as tiktoken does; `loom.data.encode.choose_backend` still checks the two give the same ids before use.
"""

from __future__ import annotations

from loom.errors import LoomError


def _pair(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            raise LoomError(f"rustbpe token {token!r} cannot be built from lower-ranked tokens")
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def tokenizer_from_ranks(ranks: dict[bytes, int], pattern: str, specials: tuple[str, ...]):
    """A tokenizers.Tokenizer with ids = ranks, the special tokens after them."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from loom.data.encode import byte_decoder

    enc = {b: c for c, b in byte_decoder().items()}

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {s(t): r for t, r in ranks.items()}
    merges = [
        tuple(s(p) for p in _pair(t, r, ranks))
        for t, r in sorted(ranks.items(), key=lambda kv: kv[1])
        if len(t) > 1
    ]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return tok


def train_rustbpe(texts, vocab_size: int, pattern: str, specials: tuple[str, ...]):
    """Train on `texts` with rustbpe; the tokenizers.Tokenizer (vocab_size ids, special tokens last)."""
    import rustbpe

    r = rustbpe.Tokenizer()
    r.train_from_iterator(iter(texts), vocab_size - len(specials), pattern=pattern)
    ranks = {bytes(k): v for k, v in r.get_mergeable_ranks()}
    return tokenizer_from_ranks(ranks, pattern, specials)
