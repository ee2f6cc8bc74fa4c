"""Memory-mapped token loader with a global cursor.

The training split is cut into windows of block_size + 1 tokens at stride block_size. Each epoch visits all
windows in an order drawn from (seed, epoch) (`WindowOrder`: computed per index, nothing of the size of the
corpus is built at start), with the window grid shifted by a per-epoch offset so repeated epochs see new cut
points. The global batch at step s is windows [s*B, (s+1)*B) of that endless sequence (with train.batch_schedule,
[W(s), W(s) + B(s)), W(s) the windows of the steps before: loom.config.schedules; with train.seq_schedule each
window cut into shorter rows): it depends only on (seed, s, B), never on how many data-parallel ranks or
micro-batches share it. Rank r of
dp_size takes the contiguous slice [r*B/dp, (r+1)*B/dp). That is what makes N processes comparable with one,
and resume exact: the whole loader state is the sample cursor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from loom import device as dev
from loom.config.schedules import StepShape
from loom.data.formats import open_split
from loom.data.formats import read_meta as formats_read_meta
from loom.data.shards import read_shard
from loom.data.slice import WHOLE, DataSlice
from loom.errors import LoomError


def read_meta(data_dir: str | Path) -> dict:
    """meta.json of a prepared directory; for a foreign one, what loom.data.formats.read_meta finds."""
    return formats_read_meta(data_dir)


def cached_bos_starts(ids: np.ndarray, bos_id: int, block_size: int) -> np.ndarray:
    """`bos_starts` of a memory-mapped shard, kept in loom's cache (LOOM_CACHE_DIR or ~/.cache/loom, under
    align/) and memory-mapped back at the next start: one scan of a shard ever, not one per rank and start
    (~1.4 s per 1B tokens of ~1,600-token documents, so over a minute per rank for a 50B-token corpus). Keyed by
    the file (path, size, modification time), the array's place in it, bos_id and block_size; a cache that
    cannot be written only costs the scan."""
    name = getattr(ids, "filename", None)
    if name is None:
        return bos_starts(ids, bos_id, block_size)
    import hashlib
    import os

    from loom.paths import cache_dir

    st = os.stat(name)
    key = repr(
        (
            str(name),
            st.st_size,
            st.st_mtime_ns,
            getattr(ids, "offset", 0),
            len(ids),
            ids.dtype.str,
            bos_id,
            block_size,
        )
    )
    path = cache_dir() / "align" / f"{hashlib.sha1(key.encode()).hexdigest()}.npy"
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):
        pass
    starts = bos_starts(ids, bos_id, block_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")  # ranks may write it at once: each its own
        np.save(tmp, starts)
        os.replace(tmp, path)
    except OSError:
        pass
    return starts


class TokenWindows:
    """Windows of block_size + 1 tokens over the shards of one split (windows never cross shards).

    `shards`: loom shard paths, or 1-D integer arrays (memory maps) as `open_split` gives for any format."""

    def __init__(
        self,
        shards: list[Path] | list[np.ndarray],
        block_size: int,
        split: str = "train",
        bos_id: int | None = None,
        vocab_size: int | None = None,
    ):
        self.block_size, self.split, self.vocab_size = block_size, split, vocab_size
        self.arrays = [s if isinstance(s, np.ndarray) else read_shard(s) for s in shards]
        total = sum(len(a) for a in self.arrays)
        self.starts: list[np.ndarray] | None = None
        self.dropped = 0
        if bos_id is not None:  # data.align=bos: every window starts at a document's first token
            self.starts = [cached_bos_starts(a, bos_id, block_size) for a in self.arrays]
            self.counts = np.array([len(s) for s in self.starts], dtype=np.int64)
            self.dropped = total - int(self.counts.sum()) * block_size
        else:  # one window per block_size tokens, keeping room for a shift of up to block_size - 1
            self.counts = np.array([max(0, len(a) // block_size - 1) for a in self.arrays], dtype=np.int64)
        if self.counts.sum() == 0:
            raise LoomError(
                f"model.block_size={block_size} is larger than the {split} split can provide ({total} tokens)",
                hint=f"use a block_size below {max(1, total // 2)} or prepare more data",
            )
        self.cum = np.concatenate([[0], np.cumsum(self.counts)])
        self.n = int(self.cum[-1])
        self.tokens = total

    def rows(self, window_ids: np.ndarray, shift: int = 0) -> torch.Tensor:
        """Gather windows as an int64 tensor of shape (len(window_ids), block_size + 1)."""
        T = self.block_size
        out = np.empty((len(window_ids), T + 1), dtype=np.int64)
        shard = np.searchsorted(self.cum, window_ids, side="right") - 1
        for i, (w, s) in enumerate(zip(window_ids, shard, strict=True)):
            if self.starts is not None:
                start = int(self.starts[s][int(w) - int(self.cum[s])])
            else:
                start = shift + (int(w) - int(self.cum[s])) * T
            out[i] = self.arrays[s][start : start + T + 1]
        # The ids are checked here, per batch, not by a scan of every token at start: a shard with ids past
        # the vocabulary (a meta.json of other data, or one taken from a sample) stops with a clear error.
        if self.vocab_size is not None and len(out) and int(out.max()) >= self.vocab_size:
            raise LoomError(
                f"the {self.split} data holds token id {int(out.max())}, outside the vocabulary of "
                f"{self.vocab_size} ids its meta gives",
                hint="record the vocabulary with `loom data inspect DIR --write-meta` (a folder without "
                "meta.json), or prepare the data again",
            )
        return torch.from_numpy(out)


def bos_starts(ids: np.ndarray, bos_id: int, block_size: int, chunk: int = 1 << 24) -> np.ndarray:
    """Window starts for data.align=bos: each at a document start (an end-of-text id, which loom puts before
    every document), the next one at the first document start at least block_size later, every window's
    block_size + 1 tokens inside the shard (as nanochat and modded-nanogpt align their rows). The tokens
    between a window's end and the next document start are not trained on. One scan of the shard."""
    docs = np.concatenate(
        [np.flatnonzero(np.asarray(ids[i : i + chunk]) == bos_id) + i for i in range(0, len(ids), chunk)]
        or [np.zeros(0, np.int64)]
    )
    docs = docs[docs + block_size + 1 <= len(ids)]
    out, i = [], 0
    while i < len(docs):
        out.append(docs[i])
        i = int(np.searchsorted(docs, docs[i] + block_size, side="left"))
    return np.asarray(out, dtype=np.int64)


_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


class WindowOrder:
    """A pseudo-random permutation of [0, n), computed index by index: a keyed Feistel network on the smallest
    even number of bits that holds n, with cycle walking (an index mapped past n is mapped again until it
    lands inside; at most 4x the domain, so ~2 passes on average). Memory and start time do not grow with n:
    a 2 GB token directory at block_size 32 has 30M windows, whose materialized permutation took 1.7 s and
    240 MB per rank at every start and every epoch. Six rounds of a splitmix64 round function keyed by
    (seed, epoch) shuffle well beyond what data order needs; it is a permutation by construction."""

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        rng = np.random.default_rng([seed, epoch, 0xFE15])
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = rng.integers(0, 1 << 63, size=self.ROUNDS, dtype=np.uint64)

    def _round(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        z = r ^ key
        z = (z ^ (z >> np.uint64(30))) * _MIX[0]
        z = (z ^ (z >> np.uint64(27))) * _MIX[1]
        return (z ^ (z >> np.uint64(31))) & self.mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __getitem__(self, index: np.ndarray | slice) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(*index.indices(self.n))
        out = self._encrypt(np.asarray(index, dtype=np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


class ShardLoader:
    """Training batches: the global batch at step s, sliced for one data-parallel rank."""

    def __init__(
        self,
        data_dir: str | Path,
        batch_size: int,
        block_size: int,
        seed: int,
        part: DataSlice = WHOLE,
        split: str = "train",
        align: str = "none",
        schedule: StepShape | None = None,
    ):
        """`schedule`: train.batch_schedule / seq_schedule's shape of each step (None: batch_size windows of
        block_size tokens every step)."""
        if batch_size % part.dp_size:
            raise LoomError(f"batch_size={batch_size} is not divisible by dp_size={part.dp_size}")
        self.windows = TokenWindows(
            open_split(data_dir, split), block_size, split, _bos_id(data_dir, align), _vocab(data_dir)
        )
        self.schedule, self.step = schedule, 0  # step: batches handed out (the schedule's step)
        if schedule is not None and max(schedule.batch.values) > self.windows.n:
            raise LoomError(
                f"train.batch_schedule asks for {max(schedule.batch.values)} sequences in a step; the {split} "
                f"split holds {self.windows.n} windows of {block_size} tokens",
                hint=f"keep every size at most {self.windows.n}, or prepare more data",
            )
        if align == "bos" and part.dp_rank == 0:
            from loom import log

            total = self.windows.tokens
            log.info(
                f"data.align=bos: {self.windows.n:,} windows start at a document start; "
                f"{self.windows.dropped:,} of {total:,} {split} tokens ({self.windows.dropped / max(1, total):.1%})"
                " are never trained on (between a window's end and the next document)"
            )
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed
        self.part = part  # this rank's rows of each global batch and its chunk of each row
        self.cursor = 0  # global samples consumed (all ranks together)
        self.order = "feistel"  # "permutation": the materialized order of checkpoints from before WindowOrder
        self._epoch: tuple[int, np.ndarray | WindowOrder, int] | None = None

    def _order(self, epoch: int) -> tuple[np.ndarray | WindowOrder, int]:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            if self.order == "permutation":  # resuming a run that started with it: the same batches
                order = rng.permutation(self.windows.n)
            else:
                order = WindowOrder(self.windows.n, self.seed, epoch)
            self._epoch = (epoch, order, int(rng.integers(self.block_size)))
        return self._epoch[1], self._epoch[2]

    def global_rows(self, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of the endless epoch sequence, as (count, T + 1) tokens."""
        n = self.windows.n
        parts, g = [], start
        while g < start + count:
            epoch, offset = divmod(g, n)
            take = min(start + count - g, n - offset)
            order, shift = self._order(epoch)
            parts.append(self.windows.rows(order[offset : offset + take], shift))
            g += take
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the next global batch: inputs and targets of shape (B / dp, T / cp). With a
        schedule, B is the step's batch and each window is cut into rows of the step's length (B * T / L, L)."""
        size = self.batch_size if self.schedule is None else self.schedule.windows(self.step)
        local = size // self.part.dp_size
        rows = self.global_rows(self.cursor + self.part.dp_rank * local, local)
        self.cursor += size
        x, y = rows[:, :-1], rows[:, 1:]  # targets: the inputs' next tokens
        if self.schedule is not None:
            length = self.schedule.seq_len(self.step)
            if length < self.block_size:  # window i's pieces are rows i*k .. i*k + k-1: every target kept
                x, y = x.reshape(-1, length), y.reshape(-1, length)
        self.step += 1
        cp = self.part.cp
        return seq_chunk(x, *cp), seq_chunk(y, *cp)

    @property
    def epoch(self) -> float:
        return self.cursor / self.windows.n

    def state_dict(self) -> dict:
        state = {
            "cursor": self.cursor,
            "seed": self.seed,
            "block_size": self.block_size,
            "windows": self.windows.n,
            "order": self.order,
        }
        if self.schedule is not None:  # the schedule's step of the next batch (the cursor follows from it)
            state["step"] = self.step
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["block_size"] != self.block_size or state["windows"] != self.windows.n:
            raise LoomError(
                "the checkpoint's data position does not fit this data "
                f"(block_size {state['block_size']} vs {self.block_size}, windows {state['windows']} vs {self.windows.n})",
                hint="resume with the same data.path and model.block_size",
            )
        self.seed, self.cursor = state["seed"], int(state["cursor"])
        # a state saved without a schedule: its batches were all batch_size windows
        self.step = int(state.get("step", self.cursor // self.batch_size))
        self.order = state.get("order", "permutation")  # a state without it was saved before WindowOrder
        self._epoch = None


def _vocab(data_dir: str | Path) -> int | None:
    """The vocabulary size the meta gives (read_meta: meta.json, meta.pkl, or the start of each shard)."""
    v = read_meta(data_dir).get("vocab_size")
    return int(v) if isinstance(v, int) else None


CP_LAYOUTS = ("contiguous", "zigzag")


def seq_chunk(x: torch.Tensor, cp_rank: int, cp_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Context parallel: cp rank cp_rank's T / cp_size tokens of the sequence dimension of (B, T) tokens.

    contiguous (Ulysses): the cp_rank-th of cp_size equal consecutive chunks. zigzag (ring attention's
    load-balanced causal layout): the sequence cut into 2 * cp_size chunks, rank r holds chunks r and
    2 * cp_size - 1 - r, concatenated, so every rank has as many early as late tokens and the causal work of
    attention is the same on each (loom.parallel.ring). seq_positions gives the tokens' places."""
    if cp_size == 1:
        return x
    if layout == "contiguous":
        T = x.size(1) // cp_size
        return x[:, cp_rank * T : (cp_rank + 1) * T]
    return x[:, seq_positions(x.size(1), cp_rank, cp_size, layout)]


def seq_positions(
    T: int, cp_rank: int, cp_size: int, layout: str = "contiguous", device=None
) -> torch.Tensor:
    """(T / cp_size,) the places in a sequence of T tokens of the tokens seq_chunk gives cp rank cp_rank, in
    the order it gives them: what learned positions and RoPE must see on that rank."""
    n = T // cp_size
    if layout == "contiguous":
        return torch.arange(cp_rank * n, (cp_rank + 1) * n, device=device)
    if layout != "zigzag":
        raise ValueError(f"unknown context-parallel layout {layout!r}; known: {', '.join(CP_LAYOUTS)}")
    c, late = n // 2, 2 * cp_size - 1 - cp_rank  # chunk size, the rank's late chunk
    return torch.cat(
        (
            torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device),
            torch.arange(late * c, (late + 1) * c, device=device),
        )
    )


def _bos_id(data_dir: str | Path, align: str) -> int | None:
    """The end-of-text id that starts each document, for data.align=bos (None for the default stream)."""
    if align == "none":
        return None
    if align != "bos":
        raise LoomError(f"data.align must be none or bos, got '{align}'")
    tok = read_meta(data_dir).get("tokenizer") or {}
    eot = tok.get("eot_id") if isinstance(tok, dict) else None
    if not isinstance(eot, int):
        raise LoomError(
            f"data.align=bos needs the end-of-text id of '{data_dir}', which its meta does not give",
            hint="prepare the data with loom (meta.json records tokenizer.eot_id), or use data.align=none",
        )
    return eot


def doc_eot_id(data_dir: str | Path, meta: dict, doc_mask: bool) -> int | None:
    """The end-of-text id whose positions separate the documents of a window, for data.doc_mask=true (None
    when it is off); data without one (no tokenizer.eot_id in its meta) is refused, naming the remedy."""
    if not doc_mask:
        return None
    tok = meta.get("tokenizer") or {}
    eot = tok.get("eot_id") if isinstance(tok, dict) else None
    if not isinstance(eot, int) or isinstance(eot, bool) or eot < 0:
        raise LoomError(
            f"data.doc_mask=true needs the end-of-text id that separates the documents of '{data_dir}', which "
            "its meta does not give",
            hint="prepare the data with loom (meta.json records tokenizer.eot_id; `loom data convert --eot-id N` "
            "for foreign data), or use data.doc_mask=false",
        )
    return eot


class DeviceBatches:
    """Training batches on the device, one step ahead of the loop.

    On a GPU the next batch is read into pinned host memory and copied with `non_blocking` as soon as the
    current one is handed out, so the copy overlaps the step instead of stalling it. `state_dict()` is the
    loader's position after the last batch handed out (not the prefetched one), so a checkpoint resumes
    exactly where the loop was."""

    def __init__(self, loader: ShardLoader, device: torch.device):
        self.loader, self.device = loader, device
        # ((x, y) on the device, the loader's state after it), or the error reading it ahead raised
        self._ahead: tuple | LoomError | None = None
        self._state: dict | None = None

    def _fetch(self) -> tuple:
        x, y = self.loader.next_batch()
        state = self.loader.state_dict()
        # an SFT loader's count of trained targets in the global batch (loom.data.sft), else None
        state["valid_targets"] = getattr(self.loader, "valid_targets", None)
        if dev.can_pin() and self.device.type in dev.ASYNC:
            x, y = (t.pin_memory().to(self.device, non_blocking=True) for t in (x, y))
        else:
            x, y = x.to(self.device), y.to(self.device)
        return (x, y), state

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        if isinstance(ahead, LoomError):
            raise ahead  # the batch asked for now is the one that could not be read ahead
        batch, self._state = ahead or self._fetch()
        self._ahead = self._fetch_ahead() if self.device.type in dev.ASYNC else None
        return batch

    def _fetch_ahead(self) -> tuple | LoomError:
        """The next batch, read ahead; a refusal (a mixture's source read through with data.mix_repeat=error)
        is kept and raised when that batch is asked for: the run's last step reads one batch past the run,
        which must not stop it."""
        try:
            return self._fetch()
        except LoomError as e:
            return e

    @property
    def valid_targets(self) -> int | None:
        """The trained targets of the global batch last handed out (SFT's loss divides by it), or None when
        every target is trained on (pretraining)."""
        return self._state.get("valid_targets") if self._state is not None else None

    def state_dict(self) -> dict:
        if self._state is None:
            return self.loader.state_dict()
        return {k: v for k, v in self._state.items() if k != "valid_targets"}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._ahead = self._state = None


class ValSet:
    """A fixed validation set: up to n_rows windows evenly spaced over the val split (no repeats)."""

    def __init__(
        self,
        data_dir: str | Path,
        block_size: int,
        n_rows: int,
        part: DataSlice = WHOLE,
    ):
        self.part = part  # this rank's share of the rows and its chunk of each row
        self.windows = TokenWindows(
            open_split(data_dir, "val"), block_size, "val", vocab_size=_vocab(data_dir)
        )
        n = min(n_rows, self.windows.n)
        ids = np.unique(np.linspace(0, self.windows.n - 1, n).round().astype(np.int64))
        self.ids = ids[
            part.dp_rank :: part.dp_size
        ]  # ranks take interleaved rows; sums are reduced across ranks
        self.total_rows = len(ids)

    def batches(self, micro_batch_size: int):
        """This rank's rows in micro-batches (inputs, targets). Every rank yields as many batches as the rank with
        the largest share, since a sharded model's forward is a collective: a rank a row short ends with a batch
        whose targets are all -1 (ignored; val_loss counts no tokens for it)."""
        share = -(-self.total_rows // self.part.dp_size)
        for i in range(0, share, micro_batch_size):
            ids = self.ids[i : i + micro_batch_size]
            if len(ids):
                rows = self.windows.rows(ids)
                x, y = rows[:, :-1], rows[:, 1:]
            else:
                x = self.windows.rows(np.zeros(1, dtype=np.int64))[:, :-1]
                y = torch.full_like(x, -1)
            yield seq_chunk(x, *self.part.cp), seq_chunk(y, *self.part.cp)
