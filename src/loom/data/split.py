"""The train/val split of a document stream, decided in stream order with bounded memory.

`docs` (the default): whole documents go to one split. Documents are gathered in windows (up to
WINDOW_CHARS characters or WINDOW_DOCS documents) and each window is split by `val_documents`, so val
holds close to `val_fraction` of the characters whatever the document sizes; a corpus that fits in one
window is split exactly as a whole. A document longer than a window is placed on its own: in val when that
keeps val's share of the characters seen so far closest to the target (with a seeded random threshold).
`tail`: the last `val_fraction` of all characters (nanogpt's 90/10 cut), which needs the total first.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from loom.data.sources import Unit
from loom.errors import LoomError

WINDOW_CHARS = 1 << 24
WINDOW_DOCS = 8192


def check_split(val_fraction: float, mode: str) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise LoomError(f"--val-fraction must be between 0 and 1, got {val_fraction}")
    if mode not in ("docs", "tail"):
        raise LoomError(f"unknown --split-mode '{mode}'", hint="use docs or tail")


def val_documents(sizes: list[int], val_fraction: float, seed) -> set[int]:
    """Indices of the val documents: val's share of the characters close to val_fraction, whatever the sizes.

    Counting documents instead sends 40-70% of the text to val when a few documents are large. In a seeded
    order, every document that still fits under the target joins val (first fit); then the one left whose
    addition lands closest to the target joins too when that is closer (always when val is still empty).
    Train keeps at least one document."""
    order = np.random.default_rng(seed).permutation(len(sizes)).tolist()
    target = val_fraction * sum(sizes)
    chosen: list[int] = []
    total = 0
    for i in order:
        if total + sizes[i] <= target:
            chosen.append(i)
            total += sizes[i]
    taken = set(chosen)
    rest = [i for i in order if i not in taken]
    best = min(rest, key=lambda i: abs(total + sizes[i] - target))
    if len(rest) > 1 and (not chosen or abs(total + sizes[best] - target) < target - total):
        chosen.append(best)
    return set(chosen)


def split_documents(
    texts: list[str], val_fraction: float, mode: str, seed: int
) -> tuple[list[str], list[str]]:
    """Train/val split of documents held in memory (the same rules as `Splitter` on a small corpus)."""
    check_split(val_fraction, mode)
    sp = Splitter(val_fraction, "tail" if mode == "tail" else mode, seed, sum(map(len, texts)))
    out: dict[str, list[str]] = {"train": [], "val": []}
    for split, u in [*(x for t in texts for x in sp.feed(Unit(t))), *sp.finish()]:
        out[split].append(u.text)
    return out["train"], out["val"]


class Splitter:
    """Assigns each unit of a stream to train or val, in order; `feed` and `finish` yield (split, unit).

    Memory: at most one window of documents is held."""

    def __init__(self, val_fraction: float, mode: str, seed: int, total_chars: int | None = None):
        check_split(val_fraction, mode)
        self.f, self.mode, self.seed = val_fraction, mode, seed
        self.window: list[list[Unit]] = []  # documents (each a list of pieces) not yet placed
        self.window_chars = 0
        self.windows = 0
        self.big: str | None = None  # the split of a document placed before its end (longer than a window)
        self.chars = {"train": 0, "val": 0}
        self.docs = {"train": 0, "val": 0}
        self.rng = np.random.default_rng([seed, 1 << 30])
        if mode == "tail":
            if total_chars is None:
                raise ValueError("tail split needs the total characters")
            self.cut = int(total_chars * (1.0 - val_fraction))
            if self.cut <= 0 or self.cut >= total_chars:
                raise LoomError(
                    f"the corpus ({total_chars} characters) is too small to split into train and val"
                )
            self.seen = 0

    def _out(self, split: str, u: Unit) -> tuple[str, Unit]:
        self.chars[split] += len(u.text)
        self.docs[split] += u.new_doc
        return split, u

    def feed(self, u: Unit) -> Iterator[tuple[str, Unit]]:
        if self.mode == "tail":
            yield from self._tail(u)
            return
        if not u.new_doc and self.big is not None:
            yield self._out(self.big, u)
            return
        if u.new_doc:
            self.big = None
            if self.window_chars >= WINDOW_CHARS or len(self.window) >= WINDOW_DOCS:
                yield from self._place_window()
            self.window.append([u])
        else:
            self.window[-1].append(u)
        self.window_chars += len(u.text)
        if sum(len(p.text) for p in self.window[-1]) > WINDOW_CHARS:  # a document longer than a window
            doc = self.window.pop()
            yield from self._place_window()
            size = sum(len(p.text) for p in doc)
            seen = self.chars["train"] + self.chars["val"] + size
            to_val = self.chars["val"] + size * float(self.rng.random()) <= self.f * seen
            self.big = "val" if to_val else "train"
            for p in doc:
                yield self._out(self.big, p)

    def _place_window(self) -> Iterator[tuple[str, Unit]]:
        docs, self.window, self.window_chars = self.window, [], 0
        if not docs:
            return
        sizes = [sum(len(p.text) for p in d) for d in docs]
        seed = self.seed if self.windows == 0 else [self.seed, self.windows]
        self.windows += 1
        val = val_documents(sizes, self.f, seed) if len(docs) > 1 else set()
        for i, d in enumerate(docs):
            for p in d:
                yield self._out("val" if i in val else "train", p)

    def finish(self) -> Iterator[tuple[str, Unit]]:
        if self.mode == "docs" and self.windows == 0 and len(self.window) == 1 and self.big is None:
            # one document in all: split its characters (nanogpt's cut), train first
            text = "".join(p.text for p in self.window[0])
            self.window = []
            self.mode, self.cut, self.seen = "tail", int(len(text) * (1.0 - self.f)), 0
            if self.cut <= 0 or self.cut >= len(text):
                raise LoomError(
                    f"the corpus ({len(text)} characters) is too small to split into train and val"
                )
            yield from self._tail(Unit(text))
            return
        yield from self._place_window()
        if self.mode == "docs" and (not self.docs["val"] or not self.docs["train"]):
            empty = "val" if not self.docs["val"] else "train"
            raise LoomError(
                f"the {empty} split got no document", hint="use --split-mode tail, or more documents"
            )

    def _tail(self, u: Unit) -> Iterator[tuple[str, Unit]]:
        start, self.seen = self.seen, self.seen + len(u.text)
        if self.seen <= self.cut:
            yield self._out("train", u)
        elif start >= self.cut:
            yield self._out("val", Unit(u.text, u.new_doc or start == self.cut))
        else:
            yield self._out("train", Unit(u.text[: self.cut - start], u.new_doc))
            yield self._out("val", Unit(u.text[self.cut - start :], True))
