"""Weighted mixtures of prepared data folders (`data.mix`): which source each training row comes from.

The global row sequence is cut into blocks of BLOCK rows. Source i's rows before block b number
floor(b * BLOCK * w_i + 1/2) (a count that only grows, so a block's quota of each source is never negative and
the realised shares stay within a few rows of the weights); inside a block the quotas' slots are shuffled by a
`WindowOrder` keyed by (seed, block). Row g's source and its index in that source's own endless epoch sequence
are then a pure function of (seed, g), computed in O(sources) per row with nothing the size of the corpus built:
every world size and layout reads the same rows, and the loader's whole state is the global cursor (each
source's cursor and epoch follow from it; the checkpoint records them, and a resume checks they agree).

`data.mix_schedule` changes the weights at given steps: each phase starts a new block grid at its first row,
from the counts the phases before it left, so the new weights show from that step on."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loom.data.loader import _MIX, ShardLoader, WindowOrder, seq_chunk
from loom.data.slice import WHOLE, DataSlice
from loom.errors import LoomError

BLOCK = 1024  # rows per block of the source grid: each block holds every source's quota to within one row
REPEAT = ("error", "warn", "allow")
CHUNK = 1024  # rows whose windows are computed together (MixLoader._chunk_of)


@dataclass(frozen=True)
class Source:
    name: str
    path: str


def parse_sources(text: str) -> dict[str, str]:
    """data.sources, "NAME=PATH,NAME=PATH": the names data.mix and data.mix_schedule may use."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, path = item.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise LoomError(
                f"data.sources: '{item}' is not NAME=PATH", hint="e.g. code=data/code,web=data/web"
            )
        if name.strip() in out:
            raise LoomError(
                f"data.sources names '{name.strip()}' twice ({out[name.strip()]} and {path.strip()})",
                hint="give each source one name",
            )
        out[name.strip()] = path.strip()
    return out


def _weight(item: str, where: str) -> tuple[str, float]:
    head, colon, w = item.rpartition(":")
    try:
        value = float(w) if colon else float("nan")
    except ValueError:
        value = float("nan")
    if not colon or not head.strip() or (value != value and w.strip().lower() not in ("nan", "+nan", "-nan")):
        raise LoomError(f"{where}: '{item}' is not SOURCE:WEIGHT", hint="e.g. code:0.3,web:0.7")
    if not math.isfinite(value):  # float() reads inf and nan: a weight no share can be drawn from
        raise LoomError(
            f"{where}: the weight of '{head.strip()}' is {w.strip()}, not a finite number",
            hint="weights are finite numbers >= 0 (normalised to sum to 1), e.g. code:0.3,web:0.7",
        )
    if value < 0:
        raise LoomError(f"{where}: the weight of '{head}' is negative ({value})", hint="weights are >= 0")
    return head.strip(), value


def parse_mix(mix: str, sources: str = "") -> tuple[list[Source], np.ndarray]:
    """data.mix, "SOURCE:WEIGHT,...", into its sources and normalised weights. SOURCE is a name of
    data.sources, NAME=PATH, or a folder (named after its last part)."""
    named = parse_sources(sources)
    out, weights = [], []
    for item in filter(None, (s.strip() for s in mix.split(","))):
        head, w = _weight(item, "data.mix")
        name, eq, path = head.partition("=")
        if eq:
            src = Source(name.strip(), path.strip())
        elif head in named:
            src = Source(head, named[head])
        elif Path(head).is_dir():
            src = Source(Path(head).name, head)
        else:
            known = ", ".join(named) or "none (data.sources is empty)"
            raise LoomError(
                f"data.mix: unknown source '{head}' (not a name of data.sources, nor a folder)",
                hint=f"known names: {known}; or write NAME=PATH:WEIGHT",
            )
        if any(s.name == src.name for s in out):
            raise LoomError(f"data.mix names the source '{src.name}' twice", hint="give each source once")
        same = next((s for s in out if Path(s.path).resolve() == Path(src.path).resolve()), None)
        if same is not None:  # two names of one folder: its rows drawn twice, with two seeds
            raise LoomError(
                f"data.mix reads the folder {src.path} twice (as '{same.name}' and '{src.name}')",
                hint="give each folder once, with the sum of the weights",
            )
        out.append(src)
        weights.append(w)
    return out, _normalised(np.array(weights, dtype=np.float64), "data.mix")


def _normalised(w: np.ndarray, where: str) -> np.ndarray:
    if len(w) == 0 or not np.isfinite(w).all() or w.sum() <= 0:
        raise LoomError(
            f"{where}: the weights sum to {w.sum()}", hint="give at least one source a weight > 0"
        )
    return w / w.sum()


def parse_schedule(text: str, sources: list[Source]) -> list[tuple[int, np.ndarray]]:
    """data.mix_schedule, "STEP@SOURCE:WEIGHT,...;STEP@...": from each STEP on, the given weights (by source
    name; a source not named weighs 0). Steps ascending."""
    names = [s.name for s in sources]
    out: list[tuple[int, np.ndarray]] = []
    for phase in filter(None, (p.strip() for p in text.split(";"))):
        step, at, rest = phase.partition("@")
        if not at or not re.fullmatch(r"\d+", step.strip()):
            raise LoomError(
                f"data.mix_schedule: '{phase}' is not STEP@SOURCE:WEIGHT,...",
                hint="e.g. 1800@code:0.7,web:0.3",
            )
        w = np.zeros(len(names))
        for item in filter(None, (s.strip() for s in rest.split(","))):
            name, value = _weight(item, "data.mix_schedule")
            if name not in names:
                raise LoomError(
                    f"data.mix_schedule: unknown source '{name}'",
                    hint=f"the sources of data.mix: {', '.join(names)}",
                )
            w[names.index(name)] = value
        s = int(step)
        if out and s <= out[-1][0]:
            raise LoomError(
                f"data.mix_schedule: step {s} is not after step {out[-1][0]}", hint="steps ascending"
            )
        out.append((s, _normalised(w, f"data.mix_schedule at step {s}")))
    return out


def check_sources(sources: list[Source], doc_mask: bool = False, align: str = "none") -> list[dict]:
    """Each source opened and checked before any work: every one in a readable format, all with one vocabulary
    and one tokenizer, and (data.doc_mask or data.align=bos) each with its end-of-text id. Returns the metas."""
    from loom.data.tokenizers import check_run_data, tokenizer_hash

    metas = [check_run_data(s.path) for s in sources]
    for s, m in zip(sources, metas, strict=True):
        tok = m.get("tokenizer") or {}
        eot = tok.get("eot_id") if isinstance(tok, dict) else None
        if (doc_mask or align == "bos") and not isinstance(eot, int):
            what = "data.doc_mask=true" if doc_mask else "data.align=bos"
            raise LoomError(
                f"{what} needs each source's end-of-text id; the meta of '{s.name}' ({s.path}) gives none",
                hint="prepare it with loom, or `loom data convert --eot-id N`, or turn the option off",
            )
    first, m0 = sources[0], metas[0]
    for s, m in zip(sources[1:], metas[1:], strict=True):
        if m.get("vocab_size") != m0.get("vocab_size"):
            raise LoomError(
                f"data.mix: '{s.name}' has {m.get('vocab_size')} token ids, '{first.name}' {m0.get('vocab_size')}",
                hint=one_tokenizer_hint(first, m0, s, m),
            )
        if tokenizer_hash(s.path, m) != tokenizer_hash(first.path, m0):
            raise LoomError(
                f"data.mix: '{s.name}' ({s.path}) was prepared with another tokenizer than '{first.name}' "
                f"({first.path})",
                hint=one_tokenizer_hint(first, m0, s, m),
            )
    return metas


def _is_char(meta: dict) -> bool:
    tok = meta.get("tokenizer")
    return isinstance(tok, dict) and tok.get("kind") == "char"


def one_tokenizer_hint(first: Source, m0: dict, other: Source, m: dict) -> str:
    """How to prepare two sources with one tokenizer, as commands that run. A char vocabulary holds its own
    text's characters only (two texts' rarely agree) and cannot be given to another preparation, so char
    sources are prepared again with a byte-level BPE trained on the first and given to the other (any text
    encodes); a source with a tokenizer file of its own gives it to the other."""

    def given(meta: dict, fallback: str) -> str:
        src = meta.get("source")
        return src if isinstance(src, str) and src else fallback

    a, b = given(m0, f"{first.name.upper()}_TEXT"), given(m, f"{other.name.upper()}_TEXT")
    if _is_char(m0) or not (Path(first.path) / "tokenizer.json").is_file():
        what = "char vocabularies hold only their own text's characters: " if _is_char(m0) else ""
        return (
            f"{what}prepare the sources with one tokenizer, a BPE trained on the first and given to the "
            f"other: loom data prepare --input {a} --tokenizer bpe --out {first.path}-bpe && loom data prepare "
            f"--input {b} --tokenizer {first.path}-bpe --out {other.path}-bpe, then mix {first.path}-bpe and "
            f"{other.path}-bpe"
        )
    return (
        f"prepare '{other.name}' with the first source's tokenizer: loom data prepare --input {b} --tokenizer "
        f"{first.path} --out {other.path}-{first.name}-tok, then mix that folder"
    )


class MixPlan:
    """Row g of the mixture -> (source, the row's index in that source's sequence): a pure function of
    (seed, g). Phases: (first row, weights), the first at row 0."""

    def __init__(self, weights: list[tuple[int, np.ndarray]], seed: int):
        self.seed, self.k = seed, len(weights[0][1])
        self.phases = []  # (first row, weights, each source's rows before it)
        self._cached: tuple | None = None  # the last block's layout and slot order (_block_at)
        base = np.zeros(self.k, dtype=np.int64)
        for i, (start, w) in enumerate(weights):
            self.phases.append((start, w, base))
            if i + 1 < len(weights):
                base = base + self._counts_in(i, weights[i + 1][0] - start)

    @staticmethod
    def _before(w: np.ndarray, block: int) -> np.ndarray:
        return np.floor(block * BLOCK * w + 0.5).astype(np.int64)  # each source's rows before block `block`

    def _layout(self, phase: int, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(each source's rows before the block, the cumulative ends of its quotas in the block)."""
        w = self.phases[phase][1]
        lo, hi = self._before(w, block), self._before(w, block + 1)
        return lo, np.cumsum(hi - lo)

    def _find_block(self, phase: int, offset: int) -> int:
        w, b = self.phases[phase][1], offset // BLOCK
        while b > 0 and self._before(w, b).sum() > offset:
            b -= 1
        while self._before(w, b + 1).sum() <= offset:
            b += 1
        return b

    def _counts_in(self, phase: int, n: int) -> np.ndarray:
        """Each source's rows among the first n rows of a phase: the rows before n's block, and its slots
        before n (the block's order is the one `rows` keeps: a cursor and the rows after it share a block)."""
        lo, ends, block_first, order = self._block_at(phase, n)
        src = np.searchsorted(ends, order[: n - block_first], side="right")
        return lo + np.bincount(src, minlength=self.k)

    def _block_at(self, phase: int, offset: int) -> tuple:
        """(each source's rows before it, quotas' cumulative ends, first row within the phase, slot order) of
        the block holding row `offset` of a phase; the last one is kept (a batch's rows share a block)."""
        c = self._cached
        if c is not None and c[0] == phase and c[3] <= offset < c[3] + int(c[2][-1]):
            return c[1:]
        w = self.phases[phase][1]
        b = self._find_block(phase, offset)
        lo, ends = self._layout(phase, b)
        # the block's whole slot order at once (~1,000 ids): cycle walking a few ids at a time costs more per batch
        order = WindowOrder(int(ends[-1]), self.seed, (phase << 40) | b)[: int(ends[-1])]
        self._cached = (phase, lo, ends, int(self._before(w, b).sum()), order)
        return self._cached[1:]

    def rows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, index in that source's own sequence) of global rows [start, start + count)."""
        src, idx, g, end = [], [], start, start + count
        while g < end:
            p = int(np.searchsorted([q[0] for q in self.phases], g, side="right") - 1)
            first, w, base = self.phases[p]
            stop = min(end, self.phases[p + 1][0]) if p + 1 < len(self.phases) else end
            lo, ends, block_first, order = self._block_at(p, g - first)
            take = min(stop, first + block_first + int(ends[-1])) - g
            slot = order[np.arange(g, g + take) - first - block_first]
            s = np.searchsorted(ends, slot, side="right")
            within = slot - np.concatenate([[0], ends[:-1]])[s]
            src.append(s)
            idx.append(base[s] + lo[s] + within)
            g += take
        return np.concatenate(src), np.concatenate(idx)

    def counts(self, g: int) -> np.ndarray:
        """Each source's rows among global rows [0, g)."""
        starts = [p[0] for p in self.phases]
        p = int(np.searchsorted(starts, g, side="right") - 1)
        return self.phases[p][2] + self._counts_in(p, g - self.phases[p][0])


def _source_seed(seed: int, i: int) -> int:
    """Source i's own data-order seed: its windows are shuffled apart from the other sources'."""
    return int(np.random.SeedSequence([seed, 0x313A, i]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def _permute(x, n, keys, half, mask) -> np.ndarray:
    """WindowOrder's permutation of each x in [0, n), every element with its own n, keys, half and mask (rows of
    several sources and epochs at once): the same Feistel rounds and cycle walking, elementwise."""

    def encrypt(v, k, h, m):
        left, right = v >> h, v & m
        for r in range(k.shape[1]):
            z = right ^ k[:, r]
            z = (z ^ (z >> np.uint64(30))) * _MIX[0]
            z = (z ^ (z >> np.uint64(27))) * _MIX[1]
            left, right = right, left ^ ((z ^ (z >> np.uint64(31))) & m)
        return (left << h) | right

    out = encrypt(x, keys, half, mask)
    outside = out >= n
    while outside.any():
        out[outside] = encrypt(out[outside], keys[outside], half[outside], mask[outside])
        outside = out >= n
    return out.astype(np.int64)


class Gather:
    """The windows of several sources as one table (their shards in a row, window ids offset by the sources
    before): a batch's rows, of any sources, gathered in one pass as TokenWindows.rows does for one."""

    def __init__(self, windows: list):
        self.T, self.vocab_size = windows[0].block_size, windows[0].vocab_size
        self.arrays = [a for w in windows for a in w.arrays]
        self.starts = [
            (w.starts[j] if w.starts is not None else None) for w in windows for j in range(len(w.arrays))
        ]
        bases = np.concatenate([[0], np.cumsum([w.n for w in windows])])
        self.base = bases[:-1]
        self.cum = np.concatenate(
            [b + w.cum[:-1] for b, w in zip(self.base, windows, strict=True)] + [bases[-1:]]
        )

    def rows(self, src: np.ndarray, window: np.ndarray, shift: np.ndarray) -> torch.Tensor:
        g = self.base[src] + window
        shard = np.searchsorted(self.cum, g, side="right") - 1
        local = g - self.cum[shard]
        T = self.T
        out = np.empty((len(g), T + 1), dtype=np.int64)
        for i, (s, w) in enumerate(zip(shard.tolist(), local.tolist(), strict=True)):
            starts = self.starts[s]
            start = int(starts[w]) if starts is not None else int(shift[i]) + w * T
            out[i] = self.arrays[s][start : start + T + 1]
        if self.vocab_size is not None and len(out) and int(out.max()) >= self.vocab_size:
            raise LoomError(
                f"the mixture's data holds token id {int(out.max())}, outside the vocabulary of {self.vocab_size}",
                hint="prepare the data again, or record its vocabulary (`loom data inspect DIR --write-meta`)",
            )
        return torch.from_numpy(out)


class MixLoader:
    """Training batches of a mixture: the global batch at step s is rows [s*B, (s+1)*B) of the mixture
    (MixPlan), each read from its source's own endless epoch sequence (a ShardLoader's windows and order);
    rank r of dp_size takes its contiguous slice, as ShardLoader does."""

    def __init__(
        self,
        sources: list[Source],
        weights: list[tuple[int, np.ndarray]],
        batch_size: int,
        block_size: int,
        seed: int,
        part: DataSlice = WHOLE,
        align: str = "none",
        repeat: str = "warn",
    ):
        if repeat not in REPEAT:
            raise LoomError(f"data.mix_repeat must be one of {', '.join(REPEAT)}, got '{repeat}'")
        if batch_size % part.dp_size:
            raise LoomError(f"batch_size={batch_size} is not divisible by dp_size={part.dp_size}")
        self.sources, self.repeat = sources, repeat
        self.loaders = [
            ShardLoader(s.path, batch_size, block_size, _source_seed(seed, i), WHOLE, align=align)
            for i, s in enumerate(sources)
        ]
        # the schedule's steps become rows: a phase starts at the first row of its step's global batch
        self.plan = MixPlan([(step * batch_size, w) for step, w in weights], seed)
        self.n_windows = np.array([ld.windows.n for ld in self.loaders], dtype=np.int64)
        self.gather = Gather([ld.windows for ld in self.loaders])
        self._chunk: tuple | None = None  # (first row, sources, windows, shifts) of the rows last computed
        k = len(sources)  # each source's window order in its newest epoch read (epoch -1: none yet)
        self.table = {
            "epoch": np.full(k, -1, dtype=np.int64),
            "keys": np.zeros((k, WindowOrder.ROUNDS), dtype=np.uint64),
            "half": np.zeros(k, dtype=np.uint64),
            "mask": np.zeros(k, dtype=np.uint64),
            "shift": np.zeros(k, dtype=np.int64),
        }
        self.batch_size, self.block_size, self.seed, self.part = batch_size, block_size, seed, part
        self.cursor = 0
        self.announced = [0] * len(sources)  # the last epoch of each source announced as a repeat

    def windows(self, i: int) -> int:
        return self.loaders[i].windows.n

    def counts(self, cursor: int | None = None) -> np.ndarray:
        """Each source's rows read before global row `cursor` (default: the loader's): its own cursor."""
        return self.plan.counts(self.cursor if cursor is None else cursor)

    def check_repeats(self, steps: int) -> None:
        """Before any work: the sources that `steps` steps read more than once, announced as data.mix_repeat
        says (error: stop now), each with the epoch it reaches and the step its second epoch starts at."""
        need = self.counts(steps * self.batch_size)
        over = [
            f"'{s.name}' {need[i] / self.windows(i):.2f} epochs (epoch 2 from step "
            f"{self._first_step_past(i, steps)}, up to epoch {-(-int(need[i]) // self.windows(i))})"
            for i, s in enumerate(self.sources)
            if need[i] > self.windows(i)
        ]
        if not over or self.repeat == "allow":
            return
        msg = f"data.mix: {steps} steps read sources more than once: {', '.join(over)}"
        if self.repeat == "error":
            raise LoomError(msg, hint="lower their weights, add data, or set data.mix_repeat=warn|allow")
        from loom import log

        if self.part.dp_rank == 0:
            log.warn(msg)

    def _first_step_past(self, i: int, steps: int) -> int:
        """The first step (1-based) whose global batch reads a row of source i's second epoch, within `steps`
        (a binary search: each source's row count only grows with the cursor)."""
        lo, hi = 1, steps
        while lo < hi:
            mid = (lo + hi) // 2
            if self.counts(mid * self.batch_size)[i] > self.windows(i):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def global_rows(self, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of the mixture, as (count, T + 1) tokens: each row the window its source's
        ShardLoader would give at that index (its WindowOrder and shift), computed for all rows at once."""
        first, src, window, shift = self._chunk_of(start, count)
        part = slice(start - first, start - first + count)
        return self.gather.rows(src[part], window[part], shift[part])

    def _chunk_of(self, start: int, count: int) -> tuple:
        """The rows' sources, windows and shifts, computed for CHUNK rows at a time (aligned, so every rank
        computes the same chunks): a permutation's cycle walking takes as many numpy passes for 1,024 rows as
        for 64."""
        c = self._chunk
        if c is None or not (c[0] <= start and start + count <= c[0] + len(c[1])):
            first = start - start % CHUNK
            n = -(-(start + count - first) // CHUNK) * CHUNK
            src, idx = self.plan.rows(first, n)
            size = self.n_windows[src]
            epochs, offsets = np.divmod(idx, size)
            keys, half, mask, shift = self._params(src, epochs)
            window = _permute(offsets.astype(np.uint64), size.astype(np.uint64), keys, half, mask)
            c = self._chunk = (first, src, window, shift)
        return c

    def _params(self, src: np.ndarray, epochs: np.ndarray) -> tuple:
        """Each row's (Feistel keys, half, mask, grid shift): its source's window order in its epoch, from a
        table of each source's newest epoch (a row of the epoch before, at an epoch's end, looked up alone)."""
        t = self.table
        for i in np.unique(src[epochs != t["epoch"][src]]).tolist():
            e = int(epochs[src == i].max())
            if e > t["epoch"][i]:
                order, shift = self.loaders[i]._order(e)
                t["epoch"][i], t["keys"][i], t["half"][i], t["mask"][i] = (
                    e,
                    order.keys,
                    order.half,
                    order.mask,
                )
                t["shift"][i] = shift
        keys, half, mask, shift = t["keys"][src], t["half"][src], t["mask"][src], t["shift"][src]
        for r in np.flatnonzero(epochs != t["epoch"][src]).tolist():
            order, sh = self.loaders[int(src[r])]._order(int(epochs[r]))
            keys[r], half[r], mask[r], shift[r] = order.keys, order.half, order.mask, sh
        return keys, half, mask, shift

    def _announce_epochs(self, end: int) -> None:
        """Each source whose rows read before global row `end` (the end of the batch about to be read, every
        rank's: all ranks decide alike) reach an epoch not announced yet. From the rows the run reads, not
        from the rows computed ahead (_chunk_of: up to CHUNK rows past the run's end), which a run that never
        reads a source twice must not be stopped or warned for."""
        if self.repeat == "allow":
            return
        read = self.counts(end)
        for i in range(len(self.sources)):
            if read[i] > 0 and (int(read[i]) - 1) // self.windows(i) > self.announced[i]:
                self._announce(i, (int(read[i]) - 1) // self.windows(i))

    def _announce(self, i: int, epoch: int) -> None:
        """A source starting its data again: data.mix_repeat says whether that stops the run or warns."""
        if epoch <= self.announced[i] or self.repeat == "allow":
            return
        self.announced[i] = epoch
        msg = (
            f"data.mix: source '{self.sources[i].name}' has been read through and starts epoch {epoch + 1} "
            f"({self.windows(i):,} windows)"
        )
        if self.repeat == "error":
            raise LoomError(msg, hint="give it a lower weight, add data, or set data.mix_repeat=warn|allow")
        from loom import log

        if self.part.dp_rank == 0:
            log.warn(msg)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the next global batch: inputs and targets of shape (B / dp, T / cp)."""
        local = self.batch_size // self.part.dp_size
        self._announce_epochs(self.cursor + self.batch_size)
        rows = self.global_rows(self.cursor + self.part.dp_rank * local, local)
        self.cursor += self.batch_size
        cp = self.part.cp
        return seq_chunk(rows[:, :-1], *cp), seq_chunk(rows[:, 1:], *cp)

    @property
    def epoch(self) -> float:
        return float(max(c / self.windows(i) for i, c in enumerate(self.counts())))

    def explain_rows(self, state: dict, batch_size: int, align: str = "none") -> dict:
        """Where the batch a state (before a step) leads to came from, for a bad step's record: its mixture rows
        [first, last], each row's [source, its row in the source's own sequence], and one `loom data inspect
        --rows` command a source (the range of its rows there; `sources` says which of them the batch read)."""
        first = int(state["cursor"])
        src, idx = self.plan.rows(first, batch_size)
        commands = []
        for i in sorted(set(src.tolist())):
            own = idx[src == i]
            commands.append(
                f"loom data inspect {self.sources[i].path} --rows {own.min()}-{own.max()} --block-size "
                f"{self.block_size} --seed {_source_seed(self.seed, i)}"
                + (" --align bos" if align == "bos" else "")
            )
        return {
            "rows": [first, first + batch_size - 1],
            "sources": [[self.sources[i].name, r] for i, r in zip(src.tolist(), idx.tolist(), strict=True)],
            "inspect": " && ".join(commands),
        }

    def state_dict(self) -> dict:
        counts = self.counts()
        return {
            "cursor": self.cursor,
            "seed": self.seed,
            "block_size": self.block_size,
            "mix": [
                {
                    "name": s.name,
                    "cursor": int(c),
                    "epoch": int(c // self.windows(i)),
                    "windows": self.windows(i),
                }
                for i, (s, c) in enumerate(zip(self.sources, counts, strict=True))
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """The cursor, checked against each source's own: a resume with other sources, weights or schedule
        would read other rows than the run it continues, and is refused."""
        if "mix" not in state or state["block_size"] != self.block_size:
            raise LoomError(
                "the checkpoint's data position is not one of this mixture",
                hint="resume with the same data.mix and model.block_size",
            )
        self.seed, self.cursor = state["seed"], int(state["cursor"])
        mine = self.state_dict()["mix"]
        if [(m["name"], m["cursor"], m["windows"]) for m in mine] != [
            (m["name"], m["cursor"], m["windows"]) for m in state["mix"]
        ]:
            raise LoomError(
                "the checkpoint's sources and their cursors differ from this data.mix's at the same step "
                f"(saved {state['mix']}, here {mine})",
                hint="resume with the data.mix, data.mix_schedule and run.seed the run started with",
            )
        # the epoch of each source's last row read (a source read exactly through has not started its next)
        self.announced = [max(0, (int(m["cursor"]) - 1) // int(m["windows"])) for m in mine]


def mix_weights(weights: np.ndarray, schedule: str, sources: list[Source]) -> list[tuple[int, np.ndarray]]:
    """The phases of a run: (first step, weights), data.mix's from step 0, then data.mix_schedule's."""
    phases = [(0, weights), *parse_schedule(schedule, sources)]
    if len(phases) > 1 and phases[1][0] == 0:
        phases = phases[1:]  # a schedule that starts at step 0 replaces data.mix's weights
    return phases


def mix_report(mix: str, sources: str = "", tokens: int = 0) -> list[dict]:
    """`loom data inspect --mix`: each source's train and val tokens and weight, and with `tokens` (a run's
    training tokens) how many of them it gives and how many epochs of it that is."""
    from loom.data.formats import open_split

    srcs, weights = parse_mix(mix, sources)
    check_sources(srcs)
    out = []
    for s, w in zip(srcs, weights.tolist(), strict=True):
        train = sum(len(a) for a in open_split(s.path, "train"))
        val = sum(len(a) for a in open_split(s.path, "val"))
        row = {"name": s.name, "path": s.path, "weight": w, "train_tokens": train, "val_tokens": val}
        if tokens:
            row.update(run_tokens=round(w * tokens), epochs=w * tokens / max(1, train))
        out.append(row)
    return out


def data_path(data) -> str:
    """data.path, or with data.mix its first source's folder (the run's vocabulary and tokenizer); '' when
    neither is given. `data`: the config's data section."""
    if data.mix and not data.path:
        return parse_mix(data.mix, data.sources)[0][0].path
    return data.path
