"""The parallel layout of a job as a value: degrees and this rank's coordinates (passed explicitly)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """dp x pp x tp = world, tp innermost (neighbouring ranks share a tensor-parallel group).

    Only dp > 1 is used so far; tp and pp are here so later strategies extend the value, not its users.
    """

    rank: int = 0
    world_size: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(f"dp*tp*pp = {self.dp * self.tp * self.pp} != world size {self.world_size}")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return (self.rank // self.tp) % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp)

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp} rank={self.rank}"
