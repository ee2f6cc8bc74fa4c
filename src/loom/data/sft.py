"""Supervised fine-tuning batches: whole conversations packed into rows, targets masked to the assistant's.

Chat data (`loom data prepare --chat`, loom.data.chat_prepare) is loom's token shards plus, beside each shard
`{split}_NNNNNN.bin`, a mask `{split}_NNNNNN.mask.npy` (uint8, one per token: 1 where the token is trained on
as a target: the assistant's tokens and its end of turn). Every conversation starts with the end-of-text id,
so the conversations are the spans between those, and data.doc_mask=true keeps each one's attention to itself.

Packing (best fit, as nanochat's SFT and Megatron's packed sequences; with data.doc_mask=true, else one
conversation a row, padded): each epoch visits the conversations in
an order drawn from (seed, epoch); each goes into the open row of block_size + 1 tokens with the least room
that still holds it whole, or opens a new row. No conversation crosses a row boundary; the rest of a row is
end-of-text tokens whose targets are ignored. A row is (row of the epoch) -> conversations, decided by the seed
alone, so the global batch at step s is rows [s*B, (s+1)*B) of the endless sequence of epochs whatever the
world size (loom.data.loader's rule), and resume needs only the cursor.

Targets are the next tokens with -1 (ignored) where the mask is 0. The loss of a step is the sum of the
trained tokens' losses over the global batch divided by their count (`valid_targets`, counted by every rank
from the global batch itself, no communication), so every layout computes the same number
(loom.train.trainer's SFT normalisation).
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch

from loom.data.formats import LOSS_MASK_SUFFIX, detect_dir, split_files
from loom.data.loader import ValSet, read_meta, seq_chunk
from loom.data.slice import WHOLE, DataSlice
from loom.errors import LoomError


def is_chat_data(meta: dict) -> bool:
    """Whether a prepared directory holds conversations with loss masks (loom data prepare --chat)."""
    return isinstance(meta.get("chat"), dict)


def mask_path(shard: Path) -> Path:
    return shard.with_name(shard.name.removesuffix(".bin") + LOSS_MASK_SUFFIX)


class Conversations:
    """The conversations of one split: tokens and masks in memory (SFT sets are small), and each one's span."""

    def __init__(self, data_dir: str | Path, split: str, block_size: int):
        data_dir = Path(data_dir)
        meta = read_meta(data_dir)
        if not is_chat_data(meta):
            raise LoomError(
                f"'{data_dir}' holds no conversations (its meta.json has no 'chat' entry)",
                hint="prepare chat data with loom data prepare --chat --input conversations.jsonl ...",
            )
        from loom.data.formats import FORMATS

        fmt = detect_dir(data_dir) or "llmc"
        shards = split_files(data_dir, split, fmt)
        if not shards:
            raise LoomError(f"'{data_dir}' has no {split} conversations", hint="prepare the data again")
        tokens, masks = [], []
        for p in shards:
            ids = np.asarray(FORMATS[fmt].open(p), dtype=np.int64)
            try:
                mask = np.load(mask_path(p), allow_pickle=False)
            except (OSError, ValueError) as e:
                raise LoomError(
                    f"the loss mask of '{p}' cannot be read ({mask_path(p).name}: {e})",
                    hint="prepare the chat data again (loom data prepare --chat)",
                ) from None
            if mask.shape != ids.shape:
                raise LoomError(
                    f"the loss mask of '{p}' has {mask.size} entries for {ids.size} tokens",
                    hint="prepare the chat data again (loom data prepare --chat)",
                )
            tokens.append(ids)
            masks.append(mask.astype(np.bool_))
        self.tokens, self.mask = np.concatenate(tokens), np.concatenate(masks)
        self.eot = int(meta["tokenizer"]["eot_id"])
        if not len(self.tokens):  # prepare_chat keeps every conversation in train when it has one only
            raise LoomError(
                f"'{data_dir}' has no {split} conversations ({meta.get('documents', 0)} in all)",
                hint="prepare at least two conversations: --val-fraction puts a share of them in val",
            )
        starts = np.flatnonzero(self.tokens == self.eot)
        if not len(starts) or starts[0] != 0:
            raise LoomError(
                f"the {split} conversations of '{data_dir}' do not start with the end-of-text id {self.eot}",
                hint="prepare the chat data again (loom data prepare --chat)",
            )
        self.starts = starts
        self.lengths = np.diff(np.append(starts, len(self.tokens)))
        too_long = int((self.lengths > block_size + 1).sum())
        if too_long:
            raise LoomError(
                f"{too_long} of {len(starts)} {split} conversations of '{data_dir}' are longer than "
                f"model.block_size + 1 = {block_size + 1} tokens (the longest: {int(self.lengths.max())})",
                hint=f"prepare the data with --block-size {block_size} (--too-long drop or truncate), or raise "
                "model.block_size",
            )
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def pack(self, order: np.ndarray, pack: bool = True) -> list[list[int]]:
        """Best-fit packing of the conversations in `order` into rows of block_size + 1 tokens (pack=False: one
        conversation a row, padded)."""
        if not pack:
            return [[c] for c in order.tolist()]
        cap = self.block_size + 1
        rows: list[list[int]] = []
        room: list[tuple[int, int]] = []  # (room left, row index), sorted: the open rows
        for c in order.tolist():
            n = int(self.lengths[c])
            i = bisect.bisect_left(room, (n, -1))
            if i < len(room):
                left, r = room.pop(i)
                rows[r].append(c)
                left -= n
            else:
                rows.append([c])
                r, left = len(rows) - 1, cap - n
            if left > 0:
                bisect.insort(room, (left, r))
        return rows

    def row(self, convs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, mask) of one packed row of block_size + 1, padded with end-of-text tokens (mask 0)."""
        cap = self.block_size + 1
        ids = np.full(cap, self.eot, dtype=np.int64)
        mask = np.zeros(cap, dtype=np.bool_)
        at = 0
        for c in convs:
            s, n = int(self.starts[c]), int(self.lengths[c])
            ids[at : at + n], mask[at : at + n] = self.tokens[s : s + n], self.mask[s : s + n]
            at += n
        return ids, mask


def _inputs_targets(ids: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T + 1) tokens and masks -> inputs and targets (B, T), targets -1 where not trained on."""
    x = torch.from_numpy(ids[:, :-1].copy())
    y = torch.from_numpy(ids[:, 1:].copy())
    y[~torch.from_numpy(mask[:, 1:].copy())] = -1
    return x, y


class ChatLoader:
    """SFT training batches: the global batch at step s (packed rows), sliced for one data-parallel rank."""

    def __init__(
        self,
        data_dir: str | Path,
        batch_size: int,
        block_size: int,
        seed: int,
        part: DataSlice = WHOLE,
        pack: bool = True,
    ):
        if batch_size % part.dp_size:
            raise LoomError(f"batch_size={batch_size} is not divisible by dp_size={part.dp_size}")
        self.data_dir, self.convs = data_dir, Conversations(data_dir, "train", block_size)
        self.pack = pack  # several conversations a row (with document masks), or one
        self.batch_size, self.seed = batch_size, seed
        self.part = part  # this rank's rows of each global batch and its chunk of each row
        self.cursor = 0  # global rows consumed (all ranks together)
        self._epochs: list[list[list[int]]] = []  # the packed rows of each epoch so far
        self.valid_targets = 0  # trained targets in the last global batch handed out

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        while len(self._epochs) <= epoch:
            e = len(self._epochs)
            order = np.random.default_rng([self.seed, e]).permutation(len(self.convs))
            self._epochs.append(self.convs.pack(order, self.pack))
        return self._epochs[epoch]

    def global_rows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, start + count) of the endless sequence of packed epochs: (tokens, masks)."""
        ids, masks = [], []
        epoch, g = 0, start
        first = 0  # the global index of `epoch`'s first row
        while len(ids) < count:
            rows = self._epoch_rows(epoch)
            if g >= first + len(rows):
                first += len(rows)
                epoch += 1
                continue
            i, m = self.convs.row(rows[g - first])
            ids.append(i)
            masks.append(m)
            g += 1
        return np.stack(ids), np.stack(masks)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the next global batch, inputs and masked targets of shape (B / dp, T / cp);
        `valid_targets` is then the global batch's count of trained targets."""
        ids, masks = self.global_rows(self.cursor, self.batch_size)
        self.valid_targets = int(masks[:, 1:].sum())
        local = self.batch_size // self.part.dp_size
        sl = slice(self.part.dp_rank * local, (self.part.dp_rank + 1) * local)
        x, y = _inputs_targets(ids[sl], masks[sl])
        self.cursor += self.batch_size
        return seq_chunk(x, *self.part.cp), seq_chunk(y, *self.part.cp)

    @property
    def epoch(self) -> float:
        """Epochs of conversations seen (whole epochs plus the share of the current one's rows)."""
        g, epoch, first = self.cursor, 0, 0
        while g >= first + len(self._epoch_rows(epoch)):
            first += len(self._epoch_rows(epoch))
            epoch += 1
        return epoch + (g - first) / len(self._epoch_rows(epoch))

    def explain_rows(self, state: dict, batch_size: int, align: str = "none") -> dict:
        """Where the batch a state (before a step) leads to came from, for a bad step's record: its global rows
        [first, last] of the packed epochs and the `loom data inspect --rows` command that prints them."""
        first, last = int(state["cursor"]), int(state["cursor"]) + batch_size - 1
        cmd = (
            f"loom data inspect {self.data_dir} --rows {first}-{last} --block-size {self.convs.block_size} "
            f"--seed {state['seed']}" + ("" if self.pack else " --no-pack")
        )
        return {"rows": [first, last], "inspect": cmd}

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "kind": "chat"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise LoomError(
                f"the checkpoint's data order was drawn with seed {state['seed']}, this run's is {self.seed}",
                hint="resume with the run's own run.seed",
            )
        self.cursor = int(state["cursor"])


class ChatValSet:
    """The validation conversations, packed once (epoch 0's order of the val split), as ValSet's interface:
    this rank's rows in micro-batches with masked targets (val_loss weighs each by its trained targets)."""

    tokens_per_byte = False  # bits per byte are the pretraining text's measure, not an SFT set's

    def __init__(
        self,
        data_dir: str | Path,
        block_size: int,
        n_rows: int,
        seed: int,
        part: DataSlice = WHOLE,
        pack: bool = True,
    ):
        self.convs = Conversations(data_dir, "val", block_size)
        order = np.random.default_rng([seed, 0]).permutation(len(self.convs))
        rows = self.convs.pack(order, pack)[:n_rows]
        self.rows = rows[part.dp_rank :: part.dp_size]
        self.part, self.total_rows = part, len(rows)

    def batches(self, micro_batch_size: int):
        share = -(-self.total_rows // self.part.dp_size)
        for i in range(0, share, micro_batch_size):
            part = self.rows[i : i + micro_batch_size] or [[0]]  # a rank a row short: one row, all ignored
            packed = [self.convs.row(r) for r in part]
            ids, masks = np.stack([p[0] for p in packed]), np.stack([p[1] for p in packed])
            if not self.rows[i : i + micro_batch_size]:
                masks[:] = False
            x, y = _inputs_targets(ids, masks)
            yield seq_chunk(x, *self.part.cp), seq_chunk(y, *self.part.cp)


class ChosenValSet(ChatValSet):
    """The validation pairs' chosen answers (preference pairs, loom.data.pairs: conversation 2i is pair i's
    chosen), one a row: the validation loss of a DPO run is its loss on the answers it is taught to prefer."""

    def __init__(self, data_dir: str | Path, block_size: int, n_rows: int, part: DataSlice = WHOLE):
        self.convs = Conversations(data_dir, "val", block_size)
        rows = [[2 * i] for i in range(len(self.convs) // 2)][:n_rows]
        self.rows = rows[part.dp_rank :: part.dp_size]
        self.part, self.total_rows = part, len(rows)


def validation_set(cfg, data_dir: Path, meta: dict, n_rows: int, part: DataSlice = WHOLE):
    """The validation rows a run measures, for the trainer and for `loom eval` of the run alike (one function,
    so the two cannot disagree): chat data's val conversations packed as training packs them (ChatValSet, the
    assistant's tokens scored), else windows of the token stream (ValSet). `cfg`: the run's loom Config;
    `part`: this rank's slice of the rows (loom eval of a run: its data-parallel ranks'); preference pairs'
    chosen answers (ChosenValSet)."""
    block = cfg.model.block_size
    if isinstance(meta.get("preference"), dict):  # preference pairs (loom.data.pairs): the chosen answers
        return ChosenValSet(data_dir, block, n_rows, part)
    if is_chat_data(meta):
        return ChatValSet(data_dir, block, n_rows, cfg.run.seed, part, pack=cfg.data.doc_mask)
    return ValSet(data_dir, block, n_rows, part)
