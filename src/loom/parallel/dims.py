"""The parallel layout of a job as a value: degrees, this rank's coordinates, and the device mesh.

Degrees, outermost first (torchtitan's order): pp, dp_replicate, dp_shard, tp. Tensor parallel is innermost
so its frequent collectives stay among neighbouring ranks (one node); dp_replicate is outside dp_shard so
HSDP shards within a node and replicates across nodes (Zhao et al. 2023, PyTorch FSDP). The data-parallel
degree is dp = dp_replicate * dp_shard: the number of different batch shards read at each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.errors import LoomError

SHARDED = ("fsdp", "zero2")  # dp_impl values that shard parameters over dp_shard (FSDP2)


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    rank: int = 0
    dp_impl: str = "none"  # none | ddp | zero1 | zero2 | fsdp | mpi

    def __post_init__(self):
        if self.dp_replicate * self.dp_shard * self.tp * self.pp != self.world_size:
            raise LoomError(
                f"dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.tp} x "
                f"{self.pp} is not the world size {self.world_size}"
            )

    @classmethod
    def from_config(cls, p, world_size: int, rank: int = 0, dp_impl: str | None = None) -> ParallelDims:
        """Degrees from the parallel config section; dp_shard=-1 takes what the other degrees leave."""
        impl = dp_impl or p.dp_impl
        if p.tp < 1 or p.pp < 1 or p.dp_replicate < 1 or (p.dp_shard < 1 and p.dp_shard != -1):
            raise LoomError(
                f"parallel degrees must be >= 1 (dp_shard may be -1: the rest); got dp_replicate={p.dp_replicate}"
                f", dp_shard={p.dp_shard}, tp={p.tp}, pp={p.pp}"
            )
        if world_size % (p.tp * p.pp):
            raise LoomError(
                f"world size {world_size} is not divisible by parallel.tp x parallel.pp = {p.tp} x {p.pp}",
                hint=f"start a multiple of {p.tp * p.pp} processes, or change tp/pp",
            )
        dp = world_size // (p.tp * p.pp)
        if impl not in SHARDED:  # replicated data parallel: every dp rank a replica
            if p.dp_shard not in (-1, 1) or p.dp_replicate not in (1, dp):
                raise LoomError(
                    f"parallel.dp_replicate/dp_shard shard parameters, which dp_impl={impl} does not do",
                    hint="use parallel.dp_impl=fsdp (or zero2) for HSDP, or leave dp_replicate/dp_shard unset",
                )
            return cls(dp, 1, p.tp, p.pp, world_size, rank, impl)
        shard = dp // p.dp_replicate if p.dp_shard == -1 else p.dp_shard
        if p.dp_replicate * shard != dp:
            raise LoomError(
                f"parallel.dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} must equal the data-parallel "
                f"degree {dp} (world {world_size} / (tp {p.tp} x pp {p.pp}))",
                hint=f"pick dp_replicate among the divisors of {dp} and leave dp_shard=-1",
            )
        return cls(p.dp_replicate, shard, p.tp, p.pp, world_size, rank, impl)

    # ----------------------------------------------------------------------------- derived degrees
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_impl in SHARDED and self.dp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def model_parallel(self) -> bool:
        """Tensor or pipeline parallel: the model itself is split, not only the batch."""
        return self.tp_enabled or self.pp_enabled

    # ----------------------------------------------------------------------------- this rank
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_shard_rank(self) -> int:
        return (self.rank // self.tp) % self.dp_shard

    @property
    def dp_replicate_rank(self) -> int:
        return (self.rank // (self.tp * self.dp_shard)) % self.dp_replicate

    @property
    def dp_rank(self) -> int:
        """Which batch shard this rank reads."""
        return self.dp_replicate_rank * self.dp_shard + self.dp_shard_rank

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def is_main(self) -> bool:
        """The rank that logs and writes files."""
        return self.rank == 0

    def build_mesh(self, device_type: str):
        """The job's DeviceMesh (pp, dp_replicate, dp_shard, tp); every sub-group is created here, once."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )  # fmt: skip

    def describe(self) -> str:
        dp = f"dp {self.dp} ({self.dp_impl}"
        if self.hsdp_enabled:
            dp += f": replicate {self.dp_replicate} x shard {self.dp_shard}"
        return dp + f") | tp {self.tp} | pp {self.pp}"

    def __str__(self) -> str:
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} pp={self.pp} "
                f"rank={self.rank}")  # fmt: skip
