"""The key/value caches attention writes to when a model generates: what a cache tells attention (the positions
of the tokens it is fed, where their keys and values go, which cached keys each query may see).

  KVCache   one length for the whole batch: a batch of equal-length rows that grow together (the harness's
            scoring, tests). Positions start .. start+T-1 for every row.
  RowCache  slots of a running batch, each with its own length (loom.engine: prompts of different lengths,
            rows that join and leave between steps). A forward runs on some of the slots (`select`), each row
            fed T tokens at its own positions len .. len+T-1; a query sees the keys at positions up to its own
            in its own row. Static: slots x max_len tokens per layer, allocated at the layer's first forward.

Both give attention the same three things: `positions(T, device)` ((T,) shared, or (B, T) per row),
`store(layer, k, v)` -> (keys, values, mask) to attend over (mask None: plain causal attention from position
0, a prefill), and `advance(T)` after the forward.
"""

from __future__ import annotations

import torch


class _Layers:
    """Per layer, a (rows, K, max_len, D) tensor made at the layer's first store, with the heads of the keys it
    is given: a tensor-parallel rank's attention holds K / tp key/value heads (loom.parallel.tensor), so the
    cache of a tp-sharded model is its shard's without the family knowing of tp."""

    def __init__(self, n_layer: int, rows: int, max_len: int, device, dtype):
        self.rows, self.max_len, self.device, self.dtype = rows, max_len, device, dtype
        self.t: list[torch.Tensor | None] = [None] * n_layer

    def at(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        if self.t[layer] is None:
            shape = (self.rows, like.size(1), self.max_len, like.size(3))
            self.t[layer] = torch.zeros(shape, device=self.device, dtype=self.dtype)
        return self.t[layer]


class KVCache:
    """Keys and values of every layer for incremental decoding: (B, K, max_T, D) per layer (key/value heads
    only: grouped-query attention shares each among H / K query heads when attention runs)."""

    def __init__(self, cfg, batch: int, max_len: int, device, dtype):
        self.k = _Layers(cfg.n_layer, batch, max_len, device, dtype)
        self.v = _Layers(cfg.n_layer, batch, max_len, device, dtype)
        self.len = 0  # tokens already cached

    def reset(self) -> None:
        self.len = 0

    def end(self, T: int) -> int:
        """The length after feeding T more tokens (the model refuses one past its positions)."""
        return self.len + T

    def positions(self, T: int, device) -> torch.Tensor:
        return torch.arange(self.len, self.len + T, device=device)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        start, T = self.len, k.size(2)
        ck, cv = self.k.at(layer, k), self.v.at(layer, v)
        ck[:, :, start : start + T] = k
        cv[:, :, start : start + T] = v
        k, v = ck[:, :, : start + T], cv[:, :, : start + T]
        if start == 0:
            return k, v, None
        # new queries see every cached key and the causal part of their own block
        return k, v, torch.ones(T, start + T, dtype=torch.bool, device=k.device).tril(diagonal=start)

    def advance(self, T: int) -> None:
        self.len += T


class RowCache:
    """Static keys and values for `slots` rows of up to max_len tokens each, every row at its own length.

    A forward runs on the rows `select` names (slot indices), each fed T tokens (a prefill of right-padded
    prompts from length 0, or one token each to decode); the caller sets a row's true length afterwards when its
    block was padded (`set_len`). Keys past a row's length (padding, or a previous occupant's) are never seen:
    each query's mask stops at its own position."""

    def __init__(self, cfg, slots: int, max_len: int, device, dtype):
        self.k = _Layers(cfg.n_layer, slots, max_len, device, dtype)
        self.v = _Layers(cfg.n_layer, slots, max_len, device, dtype)
        self.slots, self.max_len = slots, max_len
        self.lens = [0] * slots  # tokens cached per slot
        self.rows: list[int] = []
        self._pos: torch.Tensor | None = None  # (B, T) positions of the forward under way
        self._index: torch.Tensor | None = None  # (B, 1) its slots
        self._mask: torch.Tensor | None = None  # its attention mask: the same in every layer
        self._end, self._fresh, self._prefix, self._slice = 0, False, False, None  # positions() sets them

    def select(self, rows: list[int]) -> None:
        """The slots the next forward runs on, in the order of its batch."""
        self.rows, self._pos, self._mask = list(rows), None, None

    def set_len(self, slot: int, n: int) -> None:
        self.lens[slot] = n

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Slot dst[i] takes slot src[i]'s cached keys and values and its length (rows sharing a prompt:
        prefilled once, as vLLM's parallel sampling shares a prompt's blocks). One indexed copy per layer."""
        if not dst:
            return
        n = max(self.lens[s] for s in src)  # a shorter source's keys past its length are never seen
        at = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        for layers in (self.k, self.v):
            for t in layers.t:
                if t is not None:
                    t[at[1], :, :n] = t[at[0], :, :n]
        for s, d in zip(src, dst, strict=True):
            self.lens[d] = self.lens[s]

    def end(self, T: int) -> int:
        return max(self.lens[r] for r in self.rows) + T

    def positions(self, T: int, device) -> torch.Tensor:
        if self._pos is None or self._pos.size(1) != T or self._pos.device != torch.device(device):
            starts = [self.lens[r] for r in self.rows]
            self._pos = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)
            self._index = torch.tensor(self.rows, device=device)[:, None]
            self._mask = None
            # the same for every layer of the forward: its keys' length, whether it starts at 0, and the start
            # all rows share when they are the first slots at one length (a slice instead of an indexed store)
            self._end = max(starts) + T
            self._fresh = not any(starts)
            self._prefix = self.rows == list(
                range(len(self.rows))
            )  # the first slots: the cache read as a view
            self._slice = starts[0] if self._prefix and min(starts) == max(starts) else None
        return self._pos

    def _gather(self, t: torch.Tensor, L: int) -> torch.Tensor:
        n = len(self.rows)
        if self._prefix:  # the first n slots: a view, no copy
            return t[:n, :, :L]
        return t[torch.tensor(self.rows, device=t.device), :, :L]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        T = k.size(2)
        pos = self.positions(T, k.device)
        # (B, T) row and position indices around the heads' slice: the indexed block is (B, T, K, D)
        # (indexed assignment does not cast as a slice's does: under autocast k and v are bf16/fp16, the cache not)
        ck, cv = self.k.at(layer, k), self.v.at(layer, v)
        if self._slice is not None:  # slots 0..B-1 at one length (a batch decoding together)
            n, at = len(self.rows), self._slice
            ck[:n, :, at : at + T] = k
            cv[:n, :, at : at + T] = v
        else:
            ck[self._index, :, pos] = k.transpose(1, 2).to(ck.dtype)
            cv[self._index, :, pos] = v.transpose(1, 2).to(cv.dtype)
        L = self._end
        keys, values = self._gather(ck, L), self._gather(cv, L)
        if self._fresh:
            return keys, values, None  # a prefill from position 0: causal attention over the block
        if self._mask is None:  # (B, 1, T, L): 0 up to each query's own place, -inf past it
            # additive, in the keys' dtype: attention would turn a boolean mask into this in every layer
            seen = (pos[:, :, None] >= torch.arange(L, device=k.device))[:, None]
            self._mask = torch.zeros(seen.shape, dtype=keys.dtype, device=k.device).masked_fill_(
                ~seen, -torch.inf
            )
        return keys, values, self._mask

    def advance(self, T: int) -> None:
        for r in self.rows:
            self.lens[r] += T
        self._pos = self._mask = None
