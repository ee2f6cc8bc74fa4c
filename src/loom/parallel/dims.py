"""The parallel layout of a job as a value: degrees, this rank's coordinates, and the device mesh.

Degrees, outermost first (torchtitan's order): pp, dp_replicate, dp_shard, tp. Tensor parallel is innermost
so its frequent collectives stay among neighbouring ranks (one node); dp_replicate is outside dp_shard so
HSDP shards within a node and replicates across nodes (Zhao et al. 2023, PyTorch FSDP). The data-parallel
degree is dp = dp_replicate * dp_shard: the number of different batch shards read at each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import dp_degrees
from loom.errors import LoomError

SHARDED = ("fsdp", "zero2")  # dp_impl values that shard parameters over dp_shard (FSDP2)
WRAPPERS = ("ddp", "zero1", "zero2", "fsdp")  # dp_impl values with a torch wrapper (applied even on 1 rank)


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    rank: int = 0
    dp_impl: str = "none"  # none | ddp | zero1 | zero2 | fsdp | mpi
    degree1: bool = False  # parallel.degree1_meshes: tp and pp applied at degree 1 in a 1-process job

    def __post_init__(self):
        if self.dp_replicate * self.dp_shard * self.tp * self.pp != self.world_size:
            raise LoomError(
                f"dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.tp} x "
                f"{self.pp} is not the world size {self.world_size}"
            )

    @classmethod
    def from_config(cls, p, world_size: int, rank: int = 0, dp_impl: str | None = None) -> ParallelDims:
        """Degrees from the parallel config section (config.mesh_degrees has checked tp and pp)."""
        impl = dp_impl or p.dp_impl
        if world_size % (p.tp * p.pp):
            raise LoomError(
                f"world size {world_size} is not divisible by parallel.tp x parallel.pp = {p.tp * p.pp}"
            )
        replicate, shard = dp_degrees(p, world_size // (p.tp * p.pp), impl)
        return cls(replicate, shard, p.tp, p.pp, world_size, rank, impl, p.degree1_meshes and world_size == 1)

    # ----------------------------------------------------------------------------- derived degrees
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        """Data parallel is applied: more than one replica, or a 1-process job that asked for a wrapper by
        name (dp_impl=ddp|zero1|zero2|fsdp; `auto` gives `none` there), which then runs the same code on a
        1-rank group: how one GPU exercises every NCCL path (benchmarks/gpu_check.py)."""
        return self.dp > 1 or (self.world_size == 1 and self.dp_impl in WRAPPERS)

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_impl in SHARDED and self.dp_enabled

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1 or self.degree1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1 or self.degree1

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
