"""data.mix on real processes: two gloo ranks laid out as DDP (dp_replicate=2) and as FSDP (dp_shard=2) each
read their slice of every global batch of a three-source mixture with a schedule switch; concatenated, the
slices equal what one process reads at every step. Compared against: the one-process MixLoader."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import spawn_gloo
from mixkit import WEIGHTS, make_sources

from loom.config.layout import ParallelDims
from loom.data.mix import MixLoader, mix_weights, parse_mix
from loom.data.slice import WHOLE, data_slice

STEPS, BATCH, T = 60, 8, 16
SCHEDULE = "30@web:0.1,code:0.1,math:0.8"


def _loader(spec: str, part) -> MixLoader:
    srcs, w = parse_mix(spec)
    return MixLoader(srcs, mix_weights(w, SCHEDULE, srcs), BATCH, T, 1337, part, repeat="allow")


def _rank(rank: int, world: int, spec: str, impl: str, out: str) -> None:
    degrees = {"dp_replicate": 2} if impl == "ddp" else {"dp_shard": 2}
    dims = ParallelDims(**degrees, world_size=world, rank=rank, dp_impl=impl)
    mix = _loader(spec, data_slice(dims))
    torch.save([mix.next_batch()[0] for _ in range(STEPS)], f"{out}/rank{rank}.pt")


@pytest.mark.parametrize("impl", ["ddp", "fsdp"])
def test_two_ranks_read_the_rows_of_one_process(tmp_path, impl):
    sources = make_sources(tmp_path / "src")
    spec = ",".join(f"{n}={sources[n]}:{w}" for n, w in WEIGHTS.items())
    spawn_gloo(_rank, 2, tmp_path, spec, impl, str(tmp_path))
    one = _loader(spec, WHOLE)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for step in range(STEPS):
        assert torch.equal(one.next_batch()[0], torch.cat([ranks[0][step], ranks[1][step]])), step
