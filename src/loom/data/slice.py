"""Which part of every global batch this rank reads: its data-parallel rank (rows) and its context-parallel
rank (tokens of each row). Every loader takes one `DataSlice` (training batches, SFT batches, the validation
sets) instead of its five coordinates; the trainer makes it once from the job's layout (`data_slice`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.config.layout import ParallelDims


@dataclass(frozen=True)
class DataSlice:
    """Rank dp_rank of dp_size takes its share of the rows, rank cp_rank of cp_size its chunk of each row,
    laid out as cp_layout says (loom.data.loader.seq_chunk). The default is the whole batch (one process)."""

    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    cp_layout: str = "contiguous"  # parallel.cp_layout: "contiguous" (Ulysses) | "zigzag" (ring attention)

    @property
    def cp(self) -> tuple[int, int, str]:
        """(cp_rank, cp_size, cp_layout): seq_chunk's arguments."""
        return self.cp_rank, self.cp_size, self.cp_layout


WHOLE = DataSlice()  # every row and every token: a loader of one process (the default)


def data_slice(dims: ParallelDims, cp_layout: str = "contiguous") -> DataSlice:
    """The slice of the data that rank `dims.rank` of a job's layout reads (the cp ranks of one data-parallel
    rank read the same rows, each its chunk of them)."""
    return DataSlice(dims.dp_rank, dims.dp, dims.cp_rank, dims.cp, cp_layout)
