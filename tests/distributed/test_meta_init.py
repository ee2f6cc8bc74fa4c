"""Meta-device initialisation: a model built on `meta` and parallelized in any layout starts from exactly the
weights one process gets from the same seed (compared: the whole state every layout gathers to rank 0 against
`GPT.reset_parameters(seed)` on a plain CPU model), and no rank allocates the whole model."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from gloo_ranks import parallelized, spawn_gloo

from loom.config import Config
from loom.model.gpt import gpt_parallel
from loom.train.trainer import build_model

SEED, VOCAB = 1234, 70


def _cfg(**parallel) -> Config:
    cfg = Config()
    m = cfg.model
    m.n_layer, m.n_head, m.n_embd, m.block_size = 4, 4, 32, 16
    cfg.train.batch_size, cfg.run.seed = 8, SEED
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _worker(rank: int, world: int, parallel: dict, out: str, compile: bool = False) -> None:
    cfg = _cfg(**parallel)
    cfg.train.compile = compile
    _, par = parallelized(cfg, world, rank, VOCAB, SEED)  # built on meta, each rank its pieces
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in par.model.parameters())
    if compile:  # the blocks the schedule runs are the compiled ones, and a step through them works
        stages = par.pipeline.stages
        assert all(b._compiled_call_impl is not None for st in stages for b in gpt_parallel.blocks(st))
        x = torch.randint(0, VOCAB, (8, 16))
        assert torch.isfinite(par.pipeline.step(x, x, contextlib.nullcontext))
    sd = par.model_state()
    if rank == 0:
        torch.save({"state": sd, "local": local}, out)
    else:
        torch.save({"local": local}, f"{out}.{rank}")


LAYOUTS = {
    "fsdp": (2, {"dp_impl": "fsdp"}),
    "zero2": (2, {"dp_impl": "zero2"}),
    "tp": (2, {"tp": 2}),
    "pp": (2, {"pp": 2, "pp_microbatches": 2}),
    "hsdp": (4, {"dp_impl": "fsdp", "dp_replicate": 2}),
    "tp-pp": (4, {"tp": 2, "pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_starts_from_one_process_weights(tmp_path, layout):
    world, parallel = LAYOUTS[layout]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "state.pt")
    spawn_gloo(_worker, world, tmp_path, parallel, out)
    got = torch.load(out, weights_only=True)
    torch.manual_seed(0)  # the reference's init must not depend on the global RNG: reset_parameters(SEED)
    ref = build_model(_cfg(), VOCAB, "cpu")
    ref.reset_parameters(SEED)
    want = ref.state_dict()
    assert list(got["state"]) == list(want)
    for k, v in want.items():
        assert torch.equal(got["state"][k], v), k
    # each rank allocated only its pieces: sharded and split layouts hold less than the whole model
    whole = ref.num_params()
    locals_ = [got["local"]] + [torch.load(f"{out}.{r}", weights_only=True)["local"] for r in range(1, world)]
    assert max(locals_) < whole, (locals_, whole)


def test_pipeline_compiles_the_blocks_its_stages_run(tmp_path):
    """train.compile with pp > 1 compiles each block of this rank's stages (not a model the schedule never
    calls), and a pipeline step runs through them."""
    out = str(tmp_path / "state.pt")
    parallel = {"pp": 2, "pp_microbatches": 2}
    spawn_gloo(_worker, 2, tmp_path, parallel, out, True)
    assert torch.load(out, weights_only=True)["local"] > 0
