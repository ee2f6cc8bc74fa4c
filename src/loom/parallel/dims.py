"""The parallel layout of a job as a value: degrees, this rank's coordinates, and the device mesh.

ParallelDims is defined in loom.config (layer 0), where `validate(cfg, world, rank)` checks every degree rule
and returns the layout it checked; the parallel package names it from here. Degrees, outermost first
(torchtitan's order): pp, dp_replicate, dp_shard, tp (see ParallelDims).
"""

from __future__ import annotations

from loom.config import SHARDED, WRAPPERS, ParallelDims

__all__ = ["SHARDED", "WRAPPERS", "ParallelDims"]
