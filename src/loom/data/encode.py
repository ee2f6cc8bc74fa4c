"""Encoding text chunks into token ids in a pool of worker processes, in order, with bounded memory.

A chunk is a list of (split, text, new_doc) units; its result is one id array per split, each document
preceded by the end-of-text id (llm.c's convention). At most `2 x workers` chunks are in flight, so memory
does not grow with the corpus, and results come back in submission order, so the output is the same for
any number of workers.

Byte-level BPE is encoded through tiktoken when it is installed and the tokenizer converts exactly (same
pre-tokenizer pattern, vocabulary and ranks): several times faster than the tokenizers library, with the
same ids (checked on the first text before it is used; otherwise the tokenizers library encodes).
"""

from __future__ import annotations

import json
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing import get_context

import numpy as np

from loom.errors import LoomError

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s+"""
)
SPLITS = ("train", "val")

Chunk = list[tuple[int, str, bool]]  # (split index, text, starts a document)


def cpu_count() -> int:
    """Cores this process may run on (CPU affinity / cgroup cpusets), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def byte_decoder() -> dict[str, int]:
    """gpt2's byte-level alphabet: the printable character standing for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def tiktoken_spec(tokenizer_json: str) -> dict | None:
    """What tiktoken needs to encode like this tokenizer.json (pattern, ranks as {hex bytes: id}, special
    tokens), or None when it is not a plain byte-level BPE that tiktoken reproduces."""
    raw = json.loads(tokenizer_json)
    model, pre = raw.get("model") or {}, raw.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or raw.get("normalizer") or model.get("byte_fallback"):
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        pattern = GPT2_PATTERN
    elif pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        ok = len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"
        if not ok or parts[1].get("use_regex") or parts[0].get("behavior") != "Isolated":
            return None
        if parts[0].get("invert") or "Regex" not in (parts[0].get("pattern") or {}):
            return None
        pattern = parts[0]["pattern"]["Regex"]
    else:
        return None
    dec = byte_decoder()
    added = {t["content"]: t["id"] for t in raw.get("added_tokens") or []}
    ranks = {}
    for token, i in (model.get("vocab") or {}).items():
        if token in added:
            continue
        try:
            ranks[bytes(dec[c] for c in token).hex()] = i
        except KeyError:
            return None
    if len(ranks) < 256 or len(set(ranks.values())) != len(ranks):
        return None
    return {"pattern": pattern, "ranks": ranks, "special": added}


class Encoder:
    """Encodes chunks; built inside each worker from a picklable spec."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.eot = spec["eot_id"]
        self.dtype = np.dtype(spec["dtype"])
        self.kind = spec["kind"]
        if self.kind == "char":
            self.lut = np.full(0x110000, -1, dtype=np.int64)
            self.lut[[ord(c) for c in spec["chars"]]] = np.arange(len(spec["chars"]))
        elif self.kind == "sentencepiece":
            from loom.data.spm import SentencePieceTokenizer

            self.sp = SentencePieceTokenizer(spec["model"])
        elif spec.get("backend") == "tiktoken":
            import tiktoken

            t = spec["tiktoken"]
            self.enc = tiktoken.Encoding(
                "loom",
                pat_str=t["pattern"],
                special_tokens=t["special"],
                mergeable_ranks={bytes.fromhex(k): v for k, v in t["ranks"].items()},
            )
        else:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_str(spec["json"])

    def ids(self, texts: list[str]) -> list[list[int]] | list[np.ndarray]:
        """Token ids of each text (no special tokens added)."""
        if self.kind == "char":
            out = []
            for t in texts:
                a = self.lut[np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32)]
                if a.size and a.min() < 0:
                    bad = t[int(np.flatnonzero(a < 0)[0])]
                    raise LoomError(f"character {bad!r} is not in the character vocabulary")
                out.append(a)
            return out
        if self.kind == "sentencepiece":
            return self.sp.encode_batch(texts)
        if self.spec.get("backend") == "tiktoken":
            return [self.enc.encode_ordinary(t) for t in texts]
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode(self, chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
        """(train ids, val ids) of one chunk."""
        parts: tuple[list, list] = ([], [])
        for (split, _, new_doc), ids in zip(chunk, self.ids([t for _, t, _ in chunk]), strict=True):
            if new_doc:
                parts[split].append(np.array([self.eot], dtype=self.dtype))
            parts[split].append(np.asarray(ids, dtype=self.dtype))
        return tuple(np.concatenate(p) if p else np.zeros(0, self.dtype) for p in parts)


_WORKER: Encoder | None = None


def _init(spec: dict) -> None:
    global _WORKER
    # A forked worker inherits the caller's signal handlers: with a SIGTERM handler that does not exit (a
    # training loop's), the pool's terminate could not stop the workers and its exit waited forever.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends the pool
    os.environ["TOKENIZERS_PARALLELISM"] = (
        "false"  # one thread per worker process: the pool is the parallelism
    )
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER = Encoder(spec)


def _encode(chunk: Chunk) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None
    return _WORKER.encode(chunk)


def encode_chunks(spec: dict, chunks: Iterable[Chunk | None], workers: int) -> Iterator[tuple | None]:
    """Each chunk's (train ids, val ids), in order; None passes through (a chunk skipped on resume)."""
    if workers <= 1:
        enc = Encoder(spec)
        for c in chunks:
            yield None if c is None else enc.encode(c)
        return
    pending: deque = deque()
    # Forks of multiprocessing's fork server, not of this process: a fork of a process that runs other threads
    # (the tokenizers library's, a test process's gloo or store threads, a notebook's) can wait forever on a
    # lock one of them held (seen in make test: a pool worker stuck on a semaphore).
    pool = get_context("forkserver").Pool(workers, initializer=_init, initargs=(spec,))
    with pool:
        for c in chunks:
            pending.append(None if c is None else pool.apply_async(_encode, (c,)))
            while len(pending) > 2 * workers or (pending and pending[0] is None):
                r = pending.popleft()
                yield None if r is None else r.get()
        while pending:
            r = pending.popleft()
            yield None if r is None else r.get()


def choose_backend(spec: dict, sample: list[str], want: str = "auto") -> dict:
    """Pick tiktoken for a byte-level BPE when it is installed and gives the same ids on `sample`."""
    if spec["kind"] in ("char", "sentencepiece") or want == "tokenizers":
        return spec
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        if want == "tiktoken":
            raise LoomError("--encoder tiktoken needs tiktoken", hint="pip install 'loom[data]'") from None
        return spec
    tk = tiktoken_spec(spec["json"])
    if tk is None:
        if want == "tiktoken":
            raise LoomError(
                "this tokenizer.json is not a plain byte-level BPE that tiktoken can encode",
                hint="use --encoder tokenizers",
            )
        return spec
    fast = {**spec, "backend": "tiktoken", "tiktoken": tk}
    a = Encoder(spec).ids(sample)
    b = Encoder(fast).ids(sample)
    if [list(x) for x in a] != [list(x) for x in b]:
        if want == "tiktoken":
            raise LoomError(
                "tiktoken gives other ids than the tokenizers library for this tokenizer",
                hint="use --encoder tokenizers",
            )
        return spec
    return fast
