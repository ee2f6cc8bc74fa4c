"""The parallel layout of a job as a value (layer 0): `ParallelDims` (degrees, this rank's coordinates, the
device mesh) and `Derived` (the batch arithmetic printed at start). validate() builds both, so the degrees it
checked are the ones returned; `loom.parallel` and everything above take ParallelDims from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loom.errors import LoomError


@dataclass(frozen=True)
class Derived:
    """Values computed from the config and the world: printed at start, used by the trainer."""

    dp_size: int
    grad_accum: int
    tokens_per_step: int
    micro_batch_size: int
    pp_microbatches: int = 1  # with pp > 1 the schedule splits the local batch; grad_accum is then 1
    # train.batch_schedule / seq_schedule: each step's batch (loom.config.schedules.StepShape); None: every
    # step is batch_size x block_size (grad_accum, tokens_per_step above are then the last step's)
    schedule: Any = None


SHARDED = ("fsdp", "zero2")  # dp_impl values that shard parameters over dp_shard (FSDP2)
WRAPPERS = ("ddp", "zero1", "zero2", "fsdp")  # dp_impl values with a torch wrapper (applied even on 1 rank)


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout of a job as a value: degrees, this rank's coordinates, and the device mesh. Built by
    validate() (here, in layer 0, so that the degrees it checked are the ones returned); the parallel package
    and everything above import it from here.

    Degrees, outermost first (torchtitan's order): pp, dp_replicate, dp_shard, cp, tp. Tensor parallel is innermost
    so its frequent collectives stay among neighbouring ranks (one node), and context parallel's all-to-alls
    next to it; dp_replicate is outside dp_shard so HSDP shards within a node and replicates across nodes (Zhao
    et al. 2023, PyTorch FSDP). The data-parallel degree is dp = dp_replicate * dp_shard: the number of
    different batch shards read at each step (the cp ranks of one dp rank read the same rows, each a chunk).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    rank: int = 0
    dp_impl: str = "none"  # none | ddp | zero1 | zero2 | fsdp | mpi
    degree1: bool = False  # parallel.degree1_meshes: tp and pp applied at degree 1 in a 1-process job
    cp: int = 1  # context parallel: the ranks that split each sequence (between dp_shard and tp)
    ep: int = 1  # expert parallel: the routed experts split over ep of the dp x cp ranks (innermost ones)
    diloco: bool = False  # the replicate dimension is DiLoCo's (loom.parallel.diloco), not HSDP's all-reduce
    # FSDP shards the parameters (over dp_shard x cp: the cp ranks of a data-parallel rank hold the same
    # parameters, so they share the shards, as in torchtitan). A plain field, set once here: the run request
    # reads it before any process group exists, as an answer of the layout rather than a question asked again
    fsdp_enabled: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp != self.world_size:
            raise LoomError(
                f"dp_replicate x dp_shard x cp x tp x pp = {self.dp_replicate} x {self.dp_shard} x {self.cp} x "
                f"{self.tp} x {self.pp} is not the world size {self.world_size}"
            )
        fsdp = self.dp_impl in SHARDED and (self.dp_enabled or self.cp_enabled)
        object.__setattr__(self, "fsdp_enabled", fsdp)  # frozen: the one write, at construction

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
    def fsdp_shard(self) -> int:
        """The ranks each parameter is sharded over when FSDP is applied: dp_shard x cp."""
        return self.dp_shard * self.cp

    @property
    def hsdp_enabled(self) -> bool:
        return self.fsdp_enabled and self.dp_replicate > 1 and not self.diloco

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1 or self.degree1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1 or self.degree1

    @property
    def cp_enabled(self) -> bool:
        """Context parallel is applied: cp > 1, or at degree 1 with parallel.degree1_meshes (one GPU runs
        its code on a 1-rank group)."""
        return self.cp > 1 or self.degree1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def model_parallel(self) -> bool:
        """Tensor or pipeline parallel: the model itself is split, not only the batch."""
        return self.tp_enabled or self.pp_enabled

    # ----------------------------------------------------------------------------- this rank
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        """Which chunk of each sequence this rank holds (tokens cp_rank * T/cp .. (cp_rank + 1) * T/cp - 1)."""
        return (self.rank // self.tp) % self.cp

    @property
    def dp_shard_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp_shard

    @property
    def dp_replicate_rank(self) -> int:
        return (self.rank // (self.tp * self.cp * self.dp_shard)) % self.dp_replicate

    @property
    def dp_rank(self) -> int:
        """Which batch shard this rank reads."""
        return self.dp_replicate_rank * self.dp_shard + self.dp_shard_rank

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def is_main(self) -> bool:
        """The rank that logs and writes files."""
        return self.rank == 0

    def build_mesh(self, device_type: str):
        """The job's DeviceMesh (pp, dp_replicate, dp_shard, cp, tp); every sub-group is created here, once."""
        from torch.distributed.device_mesh import init_device_mesh

        from loom.compat import flatten_mesh

        mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        if self.cp_enabled:  # FSDP's shard dimension with context parallel: mesh["dp_shard_cp"]
            flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        return mesh

    def describe(self) -> str:
        dp = f"dp {self.dp} ({self.dp_impl}"
        if self.hsdp_enabled:
            dp += f": replicate {self.dp_replicate} x shard {self.dp_shard}"
        elif self.diloco:
            dp += f" inside {self.dp_replicate} DiLoCo replica(s) of {self.dp_shard}"
        cp = f" | cp {self.cp}" if self.cp > 1 else ""
        ep = f" | ep {self.ep}" if self.ep > 1 else ""
        return dp + f"){cp}{ep} | tp {self.tp} | pp {self.pp}"

    def __str__(self) -> str:
        return (
            f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
            + (f"cp={self.cp} " if self.cp > 1 else "")
            + (f"ep={self.ep} " if self.ep > 1 else "")
            + f"tp={self.tp} pp={self.pp} rank={self.rank}"
        )
